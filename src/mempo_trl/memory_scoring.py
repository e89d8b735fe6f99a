"""Step 4 of `MemPOTrainer`'s step: P_full and P_mem of the gold answer under the policy (or its reference) for the
rounds that carry scoring contexts, and their memory reward (`mempo_trl.memory.memory_scores`).

`MemoryScoring` is the part of `MemPOTrainer` that forwards the scoring contexts through the model; it reads the
trainer's ``model``, ``ref_model``, ``accelerator``, ``args``, ``protocol``, ``memory_settings`` and ``_tokenizer``.
"""

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from accelerate.utils import gather_object, is_peft_model
from trl.trainer.utils import use_adapter

from mempo_trl.context import scores_memory
from mempo_trl.grpo_mirror import activation_checkpointing_off
from mempo_trl.memory import MemoryScores, memory_scores, quantile_threshold
from mempo_trl.scoring import (
    SHARED_PREFIX_ATTENTION,
    answer_token_logps,
    pack_shared_prefix,
    shared_prefix_answer_logps,
)


def memory_off_reason(context_mode: str, settings) -> str | None:
    """Why a run with these settings trains without the memory advantage (a context rule that does not score memory,
    or ``memory_coef`` 0), None when it scores it.

    Example:
        >>> from mempo_trl.settings import MemoryRewardSettings
        >>> memory_off_reason("full_history", MemoryRewardSettings())
        "context_mode='full_history' does not score the memory reward (a rule that shows earlier rounds)"
        >>> memory_off_reason("memory", MemoryRewardSettings(memory_coef=0.0))
        'memory_coef is 0 (set memory_coef > 0 for MemPO)'
    """
    if not scores_memory(context_mode):
        return f"context_mode={context_mode!r} does not score the memory reward (a rule that shows earlier rounds)"
    if settings.memory_coef == 0.0:
        return "memory_coef is 0 (set memory_coef > 0 for MemPO)"
    return None


class MemoryScoring:
    """`MemPOTrainer`'s memory scoring: `_check_memory_scoring` once at set-up, `_memory_rewards` at every step."""

    def _check_memory_scoring(self) -> None:
        """Refuse the memory settings the loaded model cannot serve, announce a run without the memory advantage, and
        set ``shared_prefix_scoring`` (``memory_scoring``: ``shared_prefix``, or ``auto`` with 4D attention masks) and
        ``_score_memory`` (a context rule that scores memory, `scores_memory`, with ``memory_coef != 0``)."""
        settings, attention = self.memory_settings, self.model.config._attn_implementation
        if settings.memory_scoring == "shared_prefix" and attention not in SHARED_PREFIX_ATTENTION:
            raise ValueError(
                f"memory_scoring='shared_prefix' needs 4D attention masks ({SHARED_PREFIX_ATTENTION}), but the model "
                f"uses {attention!r}: set memory_scoring='batched' (or 'auto'), or attn_implementation='sdpa'."
            )
        if settings.memory_full_from_reference and self.ref_model is None and not is_peft_model(self.model):
            raise ValueError(
                "memory_full_from_reference=True needs a reference model: set beta > 0 or train a PEFT adapter."
            )
        memory_mode = scores_memory(self.protocol.context_mode)
        if self.is_world_process_zero() and (off := memory_off_reason(self.protocol.context_mode, settings)):
            print(f"mempo-trl: {off}: the memory advantage is off, this run trains on the outcome reward only.")
        self.shared_prefix_scoring = settings.memory_scoring == "shared_prefix" or (
            settings.memory_scoring == "auto" and attention in SHARED_PREFIX_ATTENTION
        )
        self._score_memory = memory_mode and settings.memory_coef != 0.0

    def _memory_rewards(self, rows: Sequence, dropped: Sequence[bool] = ()) -> MemoryScores:
        """P_full, P_mem and the memory reward of the rows that carry scoring contexts (none when the memory
        advantage is off), NaN on the rows of ``dropped`` episodes (one flag per episode): a dropped group teaches
        nothing, its memory rounds included."""
        if not self._score_memory:
            return MemoryScores.unscored(len(rows))
        scores = self._score_memory_rows(rows)
        if any(dropped):
            gone = torch.tensor([dropped[row.episode_index] for row in rows], dtype=torch.bool)
            scores = MemoryScores(*(column.masked_fill(gone, math.nan) for column in scores))
        return scores

    def _score_memory_rows(self, rows: Sequence) -> MemoryScores:
        """P_full, P_mem and the memory reward of the rows that carry scoring contexts."""
        scored = [i for i, row in enumerate(rows) if row.scoring is not None]
        pairs = [rows[i].scoring for i in scored]
        settings = self.memory_settings
        with torch.no_grad(), activation_checkpointing_off(self.model, self.args.gradient_checkpointing_kwargs):
            # Shared-prefix scoring packs the contexts of one trajectory together: its full contexts are prefixes of
            # each other, and so are its mem contexts up to their memory. The two kinds are scored apart: a mem
            # context shares only the system and user messages with the full history, so in one row its block would
            # attend over the whole history's keys for nothing.
            group_keys = [rows[i].episode_index for i in scored] if self.shared_prefix_scoring else None
            if settings.memory_full_from_reference or self.shared_prefix_scoring:
                reference = settings.memory_full_from_reference
                full_logps, full_mask = self._score_items([p.full for p in pairs], reference, group_keys)
                mem_logps, mem_mask = self._score_items([p.mem for p in pairs], False, group_keys)
            else:  # one padded batch, sorted by length, for both kinds
                logps, mask = self._score_items([p.full for p in pairs] + [p.mem for p in pairs], False)
                full_logps, mem_logps = logps[: len(pairs)], logps[len(pairs) :]
                full_mask, mem_mask = mask[: len(pairs)], mask[len(pairs) :]
        threshold = settings.memory_threshold
        if settings.memory_threshold_quantile is not None:  # one threshold for the answer tokens of all processes
            local = torch.cat([full_logps[full_mask.bool()], mem_logps[mem_mask.bool()]]).tolist()
            values = torch.tensor(gather_object(local) if self.accelerator.num_processes > 1 else local)
            threshold = quantile_threshold(
                values, torch.ones_like(values, dtype=torch.bool), settings.memory_threshold_quantile
            )
        lengths = [rows[i].mem_span[1] - rows[i].mem_span[0] + 1 for i in scored]
        parts, width = None, full_logps.shape[-1]
        if settings.memory_reward_parts != "joint" and pairs:  # the part of each answer token, padded like them
            parts = torch.tensor([list(p.answer_parts) + [0] * (width - len(p.answer_parts)) for p in pairs])
        full, mem, budget = (full_logps, full_mask), (mem_logps, mem_mask), self.protocol.max_completion_length
        return memory_scores(len(rows), scored, full, mem, lengths, settings, threshold, budget, parts)

    def _score_items(self, items, use_reference: bool, group_keys=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Answer-token log-probs of scoring items, with the same number of forwards on every process.

        With ``group_keys`` (one per item), items of the same key that share a context prefix are scored with one
        forward of that prefix (`shared_prefix_answer_logps`).
        """
        bs = self.memory_settings.memory_scoring_batch_size
        num_rows = len(items) if group_keys is None else len(pack_shared_prefix(items, group_keys))
        num_chunks = self._global_max(math.ceil(num_rows / bs))
        unwrapped = self.accelerator.unwrap_model(self.model)
        if use_reference and self.ref_model is not None:
            model, adapter_ctx = self.ref_model, nullcontext()
        elif use_reference:
            model = self.model
            adapter_ctx = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        else:
            model, adapter_ctx = self.model, nullcontext()
        pad_id = self._tokenizer.pad_token_id
        with adapter_ctx, self.accelerator.autocast():
            if group_keys is None:
                return answer_token_logps(model, items, pad_id, bs, num_chunks)
            return shared_prefix_answer_logps(model, items, group_keys, pad_id, bs, num_chunks)
