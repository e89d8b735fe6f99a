"""What `MemPOTrainer` mirrors of TRL's `GRPOTrainer`, in one place.

`MemPOTrainer` replaces `GRPOTrainer._generate_and_score_completions` (one completion per prompt) with multi-turn
episodes (one training row per round). Everything that method does besides sampling and advantages must still
happen, the same way, for the inherited loss, logging and generation backends to work; `GRPOMirror` does it. It
mirrors TRL 1.16.0, `trl/trainer/grpo_trainer.py`:

- `_stop_turns_on` / `_max_prompt_length`: the stop strings and eos ids of TRL's generation config (1763-1900), and
  the context length its backends take (``vllm_max_model_length`` or ``max_position_embeddings``);
- `_generate_turns`: one turn per prompt with `_generate_single_turn` (lines 1763-1900: HF generate, transformers
  continuous batching, vLLM colocate or server), as `_generate` (2193-2322) calls it;
- `_sync_vllm_by_reload`: where vLLM runs on the CPU, TRL's colocate weight sync (`VLLMGeneration.sync_weights`,
  ``trl/generation/vllm_generation.py`` 481-517) goes through vLLM's layerwise ``reload_weights`` instead of the
  model's ``load_weights``, which the CPU backend cannot take (see `reload_vllm_weights`);
- `_rollout_context`: the ZeRO-3 parameter gather (`unwrap_model_for_generation`, 1786-1791) and the vLLM sleep-mode
  wake-up and weight sync (1767-1771), held for the whole rollout instead of once per round;
- `_get_per_token_logps_and_entropies`: TRL's method of that name (1419-1511), for text rows: the same
  ``model(..., fused_lm_head=True)`` call through every wrapper, with only the hidden states that predict a trained
  completion token projected through the LM head (`mempo_trl.loss_forward.hidden_at`), on every device (TRL's fused
  head, `trl/trainer/utils.py` 1640-1660, compacts only on Triton devices and projects every position elsewhere);
  with ``loss_forward="shared_prefix"``, the rows' shared prompt prefixes forwarded once (`_shared_prefix_forward`);
- `_loss_log_probs`: old, sampling and reference log-probs and the vLLM importance-sampling ratio (2441-2470 and
  2629-2740);
- `_log_grpo_metrics`: ``num_tokens`` and ``completions/*`` (2274-2310), ``rewards/<func>/{mean,std}``,
  ``reward``, ``reward_std``, ``frac_reward_zero_std`` (2761-2830), the completions table (2832-2836), what reward
  functions log with ``log_extra``/``log_metric`` (2838-2855) and the importance-sampling diagnostics (2860-2895).

Differences, each deliberate: ``completions/*`` count rounds (the training rows), not whole trajectories; the
completions table shows one row per trajectory (its question and all its turns with their results).
`tests/test_grpo_mirror.py` runs `GRPOTrainer` and `MemPOTrainer` on the same one-round batch and compares these
tensors and metric names; check it after upgrading TRL.
"""

import functools
import math
from contextlib import contextmanager

import torch
from accelerate.utils import gather_object, is_peft_model
from transformers import DynamicCache
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import nanmax, nanmin, nanstd, pad, use_adapter

from mempo_trl.generation import prompt_budget
from mempo_trl.loss_forward import hidden_at, shared_prefix_inputs, trained_mask
from mempo_trl.scoring import SHARED_PREFIX_ATTENTION, cache_kwarg
from mempo_trl.stopping import ContinuousBatchingStops, action_stopping_criteria


def vllm_on_cpu(llm) -> bool:
    """Whether a `vllm.LLM` runs on vLLM's CPU backend (False for anything without vLLM's engine config)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return config is not None and config.device_config.device_type == "cpu"


def reload_vllm_weights(generation) -> None:
    """TRL's colocate weight sync through vLLM's layerwise reload: the training model's weights, as TRL's
    `VLLMGeneration._iter_named_params` yields them (PEFT merged, DeepSpeed gathered), go to
    ``collective_rpc("reload_weights", is_checkpoint_format=True)``, then the prefix cache is reset.

    vLLM's CPU backend repacks every linear weight for oneDNN after loading and drops the parameter's
    ``weight_loader``, so TRL's ``model.load_weights([(name, tensor)])`` fails there (``AttributeError: 'Parameter'
    object has no attribute 'weight_loader'``); the reload restores the checkpoint-format layers, loads the new
    tensors and repacks them.
    """
    weights = generation._iter_named_params()
    generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    generation.llm.reset_prefix_cache()


def masked_tokens_by_round(rounds, lengths, completion_mask, ratio, num_rounds: int) -> torch.Tensor:
    """``(num_rounds, 2)``: for each round, the completion tokens of the rows given and how many of them the loss
    does not train. A row's round is ``rounds[i]`` (0-based) and its length ``lengths[i]``; a token is left out
    where ``completion_mask`` ``(R, T)`` is 0 (a truncated turn under ``mask_truncated_completions``) or TRL's
    importance-sampling ``ratio`` (``(R, T)`` or ``(R, 1)``; None without it) is 0 (outside the cap of its ``*_mask``
    modes), as the loss multiplies by both.

    >>> mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    >>> ratio = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [2.0, 1.0, 1.0]])
    >>> masked_tokens_by_round([0, 1, 1], [2, 3, 1], mask, ratio, 2)
    tensor([[2., 1.],
            [4., 3.]])
    """
    trained = completion_mask.bool() if ratio is None else completion_mask.bool() & (ratio != 0)
    counts = torch.zeros(num_rounds, 2)
    for t, n, kept in zip(rounds, lengths, trained.sum(dim=1).tolist()):
        counts[t] += torch.tensor([float(n), float(n - kept)])
    return counts


@contextmanager
def activation_checkpointing_off(model, checkpointing_kwargs: dict | None = None):
    """TRL's `disable_gradient_checkpointing` under transformers 5's names: activation checkpointing is off inside
    (a no-grad forward has nothing to recompute) and on again afterwards if it was on. The old names warn
    (`FutureWarning`) on every call."""
    was_on = model.is_activation_checkpointing
    if was_on:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if was_on:
            model.activation_checkpointing_enable(checkpointing_kwargs)


class GRPOMirror:
    """Mixin for a `GRPOTrainer` subclass that builds its own batches (see the module docstring)."""

    def _sync_vllm_by_reload(self) -> None:
        """On vLLM's CPU backend (colocate mode), make TRL's `sync_weights` use `reload_vllm_weights`; elsewhere
        (GPUs, server mode) TRL's own sync runs unchanged."""
        generation = getattr(self, "vllm_generation", None)
        if self.use_vllm and self.vllm_mode == "colocate" and vllm_on_cpu(generation.llm):
            generation.sync_weights = functools.partial(reload_vllm_weights, generation)

    def _stop_turns_on(self, stops: tuple[str, ...], stop_ids: list[int]) -> None:
        """Make TRL's HF generation end each sequence after one of ``stops``: as strings, per sequence (bound to
        `generate` in `_generate_turns`, or patched into continuous batching's completion check), and as eos ids
        (``stop_ids``: `TurnProtocol.stop_token_ids`). vLLM gets them as stop strings in ``generation_kwargs``."""
        continuous = self.use_transformers_continuous_batching
        self.action_stopping_criteria = (
            None if self.use_vllm or continuous else action_stopping_criteria(self._tokenizer, stops)
        )
        self.continuous_batching_stops = ContinuousBatchingStops(self._tokenizer, stops) if continuous else None
        self.eos_token_ids = stop_ids
        if not self.use_vllm:
            self.generation_config.eos_token_id = list(stop_ids)
            self.generation_kwargs["eos_token_id"] = list(stop_ids)

    def _max_prompt_length(self) -> int | None:
        """Longest context the generation backend takes: `vllm_max_model_length` (vLLM, when set) or the model's
        `max_position_embeddings`, minus `max_completion_length`; None when neither is known."""
        limit = self.args.vllm_max_model_length if self.use_vllm else None
        limit = limit or getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return prompt_budget(limit, self.max_completion_length, "vllm_max_model_length / max_position_embeddings")

    def _generate_turns(self, prompt_ids: list[list[int]]):
        """One turn per prompt with TRL's backend, stopping after the turn's action tag.

        TRL's vLLM server mode, and colocate mode with tensor parallelism, gather the prompts of all processes (of a
        TP group) and hand each process the completions at ``process_index * len(prompts)``: right only when every
        process sends the same number of prompts. Episodes end at different rounds, so the prompt list is padded to
        the largest count over processes with copies of its shortest prompt, whose completions are dropped.
        """
        n = len(prompt_ids)
        if self.use_vllm and (self.vllm_mode == "server" or self.vllm_tensor_parallel_size > 1):
            placeholder = min(prompt_ids, key=len)
            prompt_ids = prompt_ids + [placeholder] * (self._global_max(n) - n)
        if self.continuous_batching_stops is not None:
            with self.continuous_batching_stops.active():
                completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        elif self.action_stopping_criteria is None:
            completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
        else:
            # TRL's HF path passes no stopping criteria to `generate`: bind ours for this call.
            model = self.accelerator.unwrap_model(self.model_wrapped)
            model.generate = functools.partial(model.generate, stopping_criteria=self.action_stopping_criteria)
            try:
                completions, logprobs = self._generate_single_turn(prompt_ids, None, {}, num_generations=1)
            finally:
                del model.generate
        return completions[:n], None if logprobs is None else logprobs[:n]

    @contextmanager
    def _rollout_context(self):
        """Hold the generation backend ready for all the rounds of a rollout, instead of once per round.

        - HF generation under DeepSpeed ZeRO-3 (``ds3_gather_for_generation``): TRL gathers all parameters around
          every `generate`, i.e. every round here; they are gathered once for the whole rollout (TRL's
          `unwrap_model_for_generation`), and the rounds' own `generate` calls skip their gather.
        - vLLM colocate with `vllm_enable_sleep_mode`: TRL puts vLLM to sleep (level 2, weights dropped) after every
          `generate` and re-syncs all weights before the next; here it is woken and synced once, kept awake through
          the rounds and put back to sleep after the last one.
        """
        args, generation = self.args, getattr(self, "vllm_generation", None)
        if not self.use_vllm and self.is_deepspeed_enabled and args.ds3_gather_for_generation:
            with unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            ):
                args.ds3_gather_for_generation = False  # gathered already: the rounds must not gather again
                try:
                    yield
                finally:
                    args.ds3_gather_for_generation = True
        elif self.use_vllm and self.vllm_mode == "colocate" and generation.enable_sleep_mode:
            if self.state.global_step != self._last_loaded_step or generation._llm_weights_sleeping:
                generation.sync_weights()  # wakes the weights up first
                self._last_loaded_step = self.state.global_step
            generation.llm.wake_up(tags=["kv_cache"])
            generation.enable_sleep_mode = False
            try:
                yield
            finally:
                generation.enable_sleep_mode = True
                generation.llm.sleep(level=2)
                generation._llm_weights_sleeping = True
        else:
            yield

    def _global_sum(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).sum().item())

    def _global_max(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    def _check_loss_forward(self) -> None:
        """Refuse ``loss_forward="shared_prefix"`` where it cannot run: the two forwards need 4D attention masks
        (``sdpa`` / ``eager``), a KV cache kept in the graph (activation checkpointing drops it) and one process on
        a plain model (not tested under DDP, DeepSpeed, FSDP or PEFT), without a MoE auxiliary loss."""
        args = self.args
        if args.loss_forward != "shared_prefix":
            return
        attention = self.model.config._attn_implementation
        problems = {
            f"attention {attention!r} (use attn_implementation='sdpa' or 'eager')": attention
            not in SHARED_PREFIX_ATTENTION,
            "activation_checkpointing (set activation_checkpointing=False)": args.gradient_checkpointing,
            "more than one process": self.accelerator.num_processes > 1,
            "a PEFT model": is_peft_model(self.model),
            "a Mixture-of-Experts auxiliary loss": getattr(self.model.config, "output_router_logits", False),
        }
        if asked := [name for name, on in problems.items() if on]:
            raise ValueError(
                f"loss_forward='shared_prefix' does not support {', '.join(asked)}: use loss_forward='padded'."
            )

    def _backbone(self, model) -> torch.nn.Module:
        """The module whose forward TRL's fused LM head calls for the hidden states (``base_model``), under the
        DDP / DeepSpeed / FSDP and PEFT wrappers of ``model``."""
        model = self.accelerator.unwrap_model(model)
        return (model.get_base_model() if is_peft_model(model) else model).base_model

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's per-token log-probs (and entropies, and MoE auxiliary loss) of the last ``logits_to_keep`` tokens
        of each row, in chunks of ``batch_size`` rows, with the LM head on the trained tokens only (`hidden_at`):
        the same values (up to float rounding), zero where the attention mask is 0. MemPO's rows are text: the
        multimodal arguments of TRL's method are refused."""
        if given := [name for name, value in multimodal.items() if value is not None]:
            raise ValueError(f"MemPOTrainer's loss takes text rows only, got {', '.join(given)}")
        backbone, batch_size = self._backbone(model), batch_size or input_ids.size(0)
        all_logps, all_entropies, all_aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, attention = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            mask = trained_mask(attention, logits_to_keep)
            kwargs = {"output_router_logits": True} if compute_aux_loss else {}
            shared = None
            if self.args.loss_forward == "shared_prefix":
                shared = shared_prefix_inputs(ids, attention, logits_to_keep)
            labels = ids[:, -logits_to_keep:][mask].unsqueeze(0)
            with self.accelerator.autocast():
                if shared is None:
                    with hidden_at(backbone, mask):
                        outputs = model(
                            ids, attention_mask=attention, shift_labels=labels, fused_lm_head=True, **kwargs
                        )
                else:
                    outputs = self._shared_prefix_forward(model, backbone, shared, mask, labels)
            all_logps.append(outputs.log_probs.new_zeros(mask.shape).masked_scatter(mask, outputs.log_probs[0]))
            if compute_entropy:
                all_entropies.append(outputs.entropy.new_zeros(mask.shape).masked_scatter(mask, outputs.entropy[0]))
            if compute_aux_loss:
                all_aux.append(outputs.aux_loss)
        entropies = torch.cat(all_entropies) if compute_entropy else None
        return torch.cat(all_logps), entropies, torch.stack(all_aux).mean() if compute_aux_loss else None

    def _shared_prefix_forward(self, model, backbone, shared, mask, labels):
        """The fused-head forward of `shared_prefix_inputs`' rows: the groups' prefixes into a KV cache (the head
        on one position per prefix), the cache rows repeated for each row's group (an ``index_select``: a prefix's
        keys and values get the sum of its rows' gradients), then the tails over it under the ``allowed`` mask,
        the head on the trained tokens of ``mask`` only."""
        device = next(model.parameters()).device
        # The mask's dtype is the attention scores': the autocast dtype under autocast (bf16 on a GPU), else the model's
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        dtype = dtype or next(model.parameters()).dtype
        key = cache_kwarg(model)
        cache = DynamicCache()
        model(shared.prefix_ids, use_cache=True, logits_to_keep=1, **{key: cache})
        cache.reorder_cache(shared.group_of_row)
        bias = torch.zeros((), dtype=dtype, device=device).masked_fill(~shared.allowed, torch.finfo(dtype).min)
        with hidden_at(backbone, mask):
            return model(
                shared.tail_ids,
                attention_mask=bias.unsqueeze(1),
                position_ids=shared.tail_positions,
                shift_labels=labels,
                fused_lm_head=True,
                **{key: cache},
            )

    def _loss_log_probs(self, batch: dict[str, torch.Tensor], sampling_logps, mode: str) -> dict[str, torch.Tensor]:
        """What the inherited loss needs besides advantages: old / sampling / reference log-probs and the vLLM
        importance-sampling ratio, as `GRPOTrainer` computes them.

        ``sampling_logps``: the generation backend's log-probs of each real row's completion (rows of ``batch`` past
        them are placeholders), or None when it reports none; vLLM's None entries (NaN log-probs) become NaN.
        """
        args = self.args
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        prompt_completion_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        # As many rows per forward as a loss micro-batch holds (not per_device_train_batch_size trajectories), so
        # that a ZeRO-3 step gathers the parameters `steps_per_generation` times, not once per trajectory pair.
        per_step = args.steps_per_generation if mode == "train" else 1
        batch_size = completion_ids.size(0) // per_step

        def logps_of(model):
            return self._get_per_token_logps_and_entropies(
                model, prompt_completion_ids, attention_mask, logits_to_keep, batch_size=batch_size
            )[0]

        output = {}
        with torch.no_grad(), activation_checkpointing_off(self.model, args.gradient_checkpointing_kwargs):
            generate_every = args.steps_per_generation * self.num_iterations
            use_is = self.use_vllm and self.vllm_importance_sampling_correction
            if args.gradient_accumulation_steps % generate_every != 0 or use_is:
                output["old_per_token_logps"] = logps_of(self.model)
            if self.use_vllm and sampling_logps is not None:
                num_dummy = completion_ids.size(0) - len(sampling_logps)
                sampling = pad(
                    [torch.tensor([math.nan if x is None else x for x in row]) for row in sampling_logps]
                    + [torch.zeros(1)] * num_dummy,
                    padding_value=0.0,
                    padding_side="right",
                    pad_to_multiple_of=self.pad_to_multiple_of,
                ).to(self.accelerator.device)
                output["sampling_per_token_logps"] = sampling
                if use_is:
                    ratio = self._importance_sampling_ratio(output["old_per_token_logps"], sampling, completion_mask)
                    output["importance_sampling_ratio"] = ratio
                    self._log_importance_sampling(
                        mode, output["old_per_token_logps"], sampling, ratio, completion_mask
                    )
            if self.beta != 0.0:
                if self.ref_model is not None:
                    output["ref_per_token_logps"] = logps_of(self.ref_model)
                else:
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                        output["ref_per_token_logps"] = logps_of(self.model)
        return output

    def _importance_sampling_ratio(self, old_logps, sampling_logps, mask):
        """vLLM importance-sampling ratio with TRL's truncate/mask modes, per token or per sequence."""
        diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
        if self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if self.vllm_importance_sampling_mode.endswith("truncate"):
            return torch.clamp(ratio, min=low, max=high)
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    def _log_importance_sampling(self, mode, old_logps, sampling_logps, ratio, mask):
        """TRL's vLLM diagnostics: ``sampling/sampling_logp_difference/{mean,max}`` and
        ``sampling/importance_sampling_ratio/{min,mean,max}`` over real completion tokens, NaN log-probs skipped."""
        device = self.accelerator.device
        mask = mask.bool()
        delta = (old_logps - sampling_logps).abs()
        delta = delta[mask & ~torch.isnan(delta)]
        zero = torch.tensor(0.0, device=device)
        mean_delta, max_delta = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        metrics = self._metrics[mode]
        metrics["sampling/sampling_logp_difference/mean"].append(self.accelerator.gather(mean_delta).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(self.accelerator.gather(max_delta).max().item())
        flat = ratio.flatten() if self.vllm_importance_sampling_mode.startswith("sequence") else ratio[mask]
        stats = (flat.min(), flat.mean(), flat.max()) if flat.numel() else (zero, zero, zero)
        low, mean, high = (self.accelerator.gather(x) for x in stats)
        metrics["sampling/importance_sampling_ratio/min"].append(nanmin(low).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(mean.nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(nanmax(high).item())

    def _log_masked_tokens(self, mode, records, batch: dict[str, torch.Tensor], ratio) -> None:
        """Log ``tokens/masked_share`` and ``tokens/masked_share/round_<t>``: the share of the completion tokens of
        ``records`` (this process's real rows; all processes counted, rows of dropped groups left out) that the loss
        does not train because truncation or the importance-sampling cap masked them (`masked_tokens_by_round`)."""
        real = batch["real_rows"][: len(records)].tolist()
        index = [i for i, keep in enumerate(real) if keep]
        counts = masked_tokens_by_round(
            [records[i].round_index for i in index],
            [len(records[i].completion_ids) for i in index],
            batch["completion_mask"][index],
            None if ratio is None else ratio[index],
            self.args.max_turns,
        )
        totals = self.accelerator.gather(counts.to(self.accelerator.device).unsqueeze(0)).sum(dim=0).tolist()
        metrics = self._metrics[mode]
        tokens, masked = (sum(column) for column in zip(*totals))
        metrics["tokens/masked_share"].append(masked / tokens if tokens else 0.0)
        for t, (round_tokens, round_masked) in enumerate(totals, start=1):
            if round_tokens:
                metrics[f"tokens/masked_share/round_{t}"].append(round_masked / round_tokens)

    def _log_grpo_metrics(self, mode, records, rewards_per_func, rewards, advantages, prompts, completions) -> None:
        """The metrics and completions-table rows `GRPOTrainer` logs for a batch.

        Args:
            records: this process's real rows (`TrainingRow`: ``prompt_ids``, ``completion_ids``, ``truncated``).
            rewards_per_func / rewards: ``(N, F)`` / ``(N,)`` rewards of the trajectories of all processes (NaN:
                unscorable).
            advantages: ``(N,)`` outcome advantages of all processes' trajectories (the table's column).
            prompts / completions: this process's trajectories, as the table shows them.
        """
        device, metrics = self.accelerator.device, self._metrics[mode]
        local = [(len(r.completion_ids), r.truncated) for r in records]  # processes hold different numbers of rows
        everything = gather_object(local) if self.accelerator.num_processes > 1 else local
        lengths = torch.tensor([float(n) for n, _ in everything])
        truncated = torch.tensor([t for _, t in everything])
        prompt_tokens = self._global_sum(sum(len(r.prompt_ids) for r in records))
        if mode == "train":
            self.state.num_input_tokens_seen += prompt_tokens + int(lengths.sum().item())
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/min_length"].append(lengths.min().item())
        metrics["completions/max_length"].append(lengths.max().item())
        metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
        terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        metrics["completions/mean_terminated_length"].append(terminated.mean().item())
        metrics["completions/min_terminated_length"].append(terminated.min().item())
        metrics["completions/max_terminated_length"].append(terminated.max().item())
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        metrics["reward"].append(torch.nanmean(rewards).item())
        metrics["reward_std"].append(nanstd(rewards).item())
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if self.scale_rewards == "batch" or num_generations == 1:
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        metrics["frac_reward_zero_std"].append(torch.isclose(std, torch.zeros_like(std)).float().mean().item())
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(advantages.tolist())
        # What reward functions logged (log_extra: one table value per trajectory; log_metric: scalars averaged over
        # processes); names sorted so that all processes gather in the same order.
        for column in sorted(set(gather_object(list(self._pending_extra_logs)))):
            values = self._pending_extra_logs.get(column, [None] * len(prompts))
            self._logs["extra"][column].extend(gather_object(values))
        self._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(self._pending_metrics)))):
            values = self._pending_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            metrics[name].append(total / count)
        self._pending_metrics.clear()
