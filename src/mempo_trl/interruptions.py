"""Training that stops before `max_steps` and keeps its work: preemption signals and non-finite values.

`SaveOnSignalCallback`: on SIGTERM (what cluster schedulers send before preempting a job), SIGINT (Ctrl-C) or SIGHUP
(the terminal closed), the current step finishes, every process agrees to stop at the same step, a complete
checkpoint is saved and training ends; `mempo-trl train` then prints how to resume and exits 2. A repeat of the
signal within `REPEAT_GRACE_SECONDS` (a launcher forwarding the one the terminal already sent) is ignored; a later one
ends the process at once, as without the callback. After training, `mempo-trl train` keeps the handlers while it
saves the final model (a signal then waits for the save), and stops the evaluation after training at once
(`interruptible`): the saved model is kept.

`check_finite`: a non-finite advantage or loss stops training before the optimizer applies it, with
`NonFiniteError` naming the step; the weights keep their last finite values.
"""

import contextlib
import signal
import time

import torch
from transformers import TrainerCallback


REPEAT_GRACE_SECONDS = 5.0
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class TrainingStopped(RuntimeError):
    """Training ended before `max_steps`; the message says why, and `mempo-trl train` adds the checkpoint."""


class StoppedBySignal(TrainingStopped):
    """A stop signal arrived inside `SaveOnSignalCallback.interruptible`; the message is the signal's name."""


class NonFiniteError(TrainingStopped):
    """A NaN or infinite advantage or loss; nothing of that step was applied to the weights."""


class PeerLost(TrainingStopped):
    """A collective failed: another process of the run (on another machine, say) ended or stopped answering, so the
    processes left can save nothing together."""


def is_peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a failed collective: one of torch.distributed's errors, or a gloo error (a plain
    RuntimeError naming gloo, raised when a peer's connection closes or the process group's timeout passes).

    Example:
        >>> is_peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
        True
    """
    import torch.distributed

    if isinstance(err, torch.distributed.DistError):
        return True
    return isinstance(err, RuntimeError) and "/gloo/" in str(err)


def peer_lost_message(err: BaseException, step: int, timeout: int, checkpoint) -> str:
    """The line that ends a process whose peer is gone (`is_peer_lost`): the step, the failure (its first line,
    without gloo's source location and advice), the bound waited (``timeout``, `ddp_timeout`) and how to go on from
    ``checkpoint`` (the newest complete one, or None).

    Example:
        >>> err = RuntimeError("[x/gloo/y.cc:1] Timed out waiting 30000ms")
        >>> print(peer_lost_message(err, 7, 30, "out/ckpt-5"))  # doctest: +NORMALIZE_WHITESPACE
        training stopped after step 7: another process of the run ended or stopped answering (Timed out waiting
        30000ms; this process waits at most ddp_timeout=30 s for one). Nothing can be saved without it: start every
        machine again with --resume_from_checkpoint out/ckpt-5.
    """
    import re

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    reason = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0].rstrip(".")
    go_on = (
        f"start every machine again with --resume_from_checkpoint {checkpoint}"
        if checkpoint
        else "no checkpoint was saved yet, start every machine again"
    )
    return (
        f"training stopped after step {step}: another process of the run ended or stopped answering "
        f"({reason}; this process waits at most ddp_timeout={timeout} s for one). Nothing can be saved without it: "
        f"{go_on}."
    )


def check_finite(name: str, values: torch.Tensor, step: int, accelerator=None) -> None:
    """Raise `NonFiniteError` (on every process alike) if any process's `values` hold a NaN or an infinity.

    Example:
        >>> check_finite("loss", torch.tensor(float("nan")), step=4)
        Traceback (most recent call last):
        mempo_trl.interruptions.NonFiniteError: step 4: the loss is not finite (nan on 1 of 1 values). ...
    """
    bad = (~torch.isfinite(values.detach())).sum().reshape(1)
    if accelerator is not None and accelerator.num_processes > 1:
        bad = accelerator.gather(bad.to(accelerator.device)).sum().reshape(1)
    if bad.item():
        local = values.detach().flatten()
        example = local[~torch.isfinite(local)][:1].tolist() or ["non-finite values on another process"]
        raise NonFiniteError(
            f"step {step}: the {name} is not finite ({example[0]} on {int(bad.item())} of "
            f"{values.numel()} values); it was not applied. Lower learning_rate, check custom reward functions "
            "(they must return finite numbers) and the memory settings"
        )


class SaveOnSignalCallback(TrainerCallback):
    """On SIGTERM, SIGINT or SIGHUP: finish the step, save a checkpoint on every process, stop (see the module
    docstring).

    Holds the trainer for its accelerator: the processes agree through a gather at every step end, so that all of
    them stop (and save) at the same step even if only one received the signal. `received` is the name of the
    signal that stopped training, or None; `pending` the name of any signal received so far, or None. With
    ``keep_handlers`` the handlers stay after training until `restore` (else training's end restores them).
    """

    def __init__(self, trainer, keep_handlers: bool = False):
        self.trainer = trainer
        self.keep_handlers = keep_handlers
        self.received: str | None = None
        self._pending = 0
        self._first_at = 0.0
        self._previous = {}
        self._training = False
        self._interrupting = False

    @property
    def pending(self) -> str | None:
        return signal.Signals(self._pending).name if self._pending else None

    def _handle(self, signum, frame):
        if self._pending and time.monotonic() - self._first_at > REPEAT_GRACE_SECONDS:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)  # asked twice: stop now, as without this callback
            return
        if self._pending:
            return
        self._pending, self._first_at = signum, time.monotonic()
        if self._interrupting:
            raise StoppedBySignal(self.pending)
        if self.trainer.is_world_process_zero():
            doing = (
                f"finishing step {self.trainer.state.global_step + 1}, then saving a checkpoint"
                if self._training
                else "finishing the final save"
            )
            with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
                print(f"mempo-trl: {self.pending} received: {doing} and stopping.", flush=True)

    @contextlib.contextmanager
    def interruptible(self):
        """Within, a stop signal raises `StoppedBySignal` at once (also one received before entering), instead of
        waiting for the step to end: for work after training that may be cut short, such as the final evaluation."""
        if self._pending:
            raise StoppedBySignal(self.pending)
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._training = True
        for signum in STOP_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (a notebook worker, say): signals keep their meaning
                return

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        pending = torch.tensor([self._pending], device=accelerator.device)
        if accelerator.num_processes > 1:
            pending = accelerator.gather(pending)
        signum = int(pending.max().item())
        if signum:
            self.received = signal.Signals(signum).name
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        if not self.keep_handlers:
            self.restore()

    def restore(self) -> None:
        """Give the stop signals back their handlers from before training (also when training raised)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
