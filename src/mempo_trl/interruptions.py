"""Training that stops before `max_steps` and keeps its work: preemption signals and non-finite values.

`SaveOnSignalCallback`: on SIGTERM (what cluster schedulers send before preempting a job) or SIGINT (Ctrl-C), the
current step finishes, every process agrees to stop at the same step, a complete checkpoint is saved and training
ends; `mempo-trl train` then prints how to resume and exits 2. A repeat of the signal within
`REPEAT_GRACE_SECONDS` (a launcher forwarding the one the terminal already sent) is ignored; a later one ends the
process at once, as without the callback.

`check_finite`: a non-finite advantage or loss stops training before the optimizer applies it, with
`NonFiniteError` naming the step; the weights keep their last finite values.
"""

import signal
import time

import torch
from transformers import TrainerCallback


REPEAT_GRACE_SECONDS = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(RuntimeError):
    """Training ended before `max_steps`; the message says why, and `mempo-trl train` adds the checkpoint."""


class NonFiniteError(TrainingStopped):
    """A NaN or infinite advantage or loss; nothing of that step was applied to the weights."""


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
    """On SIGTERM or SIGINT: finish the step, save a checkpoint on every process, stop (see the module docstring).

    Holds the trainer for its accelerator: the processes agree through a gather at every step end, so that all of
    them stop (and save) at the same step even if only one received the signal. `received` is the name of the
    signal that stopped training, or None.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.received: str | None = None
        self._pending = 0
        self._first_at = 0.0
        self._previous = {}

    def _handle(self, signum, frame):
        if self._pending and time.monotonic() - self._first_at > REPEAT_GRACE_SECONDS:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)  # asked twice: stop now, as without this callback
            return
        if not self._pending:
            self._pending, self._first_at = signum, time.monotonic()
            if self.trainer.is_world_process_zero():
                print(
                    f"mempo-trl: {signal.Signals(signum).name} received: finishing step "
                    f"{self.trainer.state.global_step + 1}, then saving a checkpoint and stopping.",
                    flush=True,
                )

    def on_train_begin(self, args, state, control, **kwargs):
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
        self.restore()

    def restore(self) -> None:
        """Give SIGTERM and SIGINT back their handlers from before training (also when training raised)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
