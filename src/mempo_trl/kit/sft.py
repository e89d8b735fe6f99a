"""`CompletionSFTTrainer`: TRL's `SFTTrainer` with a loss that projects only the labelled positions on any device.

Its own module because importing TRL takes seconds, and `mempo_trl.kit.warmstart` is imported by the CLI.
"""

import torch
from accelerate.utils import is_peft_model
from trl import SFTTrainer


# The config fields with which `add_fused_lm_head` scales or soft-caps the logits
_LOGIT_SCALES = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


class CompletionSFTTrainer(SFTTrainer):
    """`SFTTrainer` whose `compute_loss` projects through the LM head only the positions that have a label.

    TRL 1.16's `SFTTrainer.compute_loss` calls ``model(**inputs, fused_lm_head=True)``
    (`trl.trainer.utils.add_fused_lm_head`), which on a device without Triton (a CPU) scores every position of
    the batch, prompts and padding included, through its chunked log-prob kernel, then zeroes the unlabelled ones.
    This override is the same loss with only the labelled positions scored, on every device (one code path):

    - the backbone (``model.base_model``, as `add_fused_lm_head` finds it) runs once on the inputs without the
      labels, and ``lm_head(hidden[:, :-1][mask])`` projects the hidden states whose next-token label is not -100;
    - loss = summed cross-entropy / (``num_items_in_batch``, else the number of label tokens, at least 1), as TRL's
      default ``loss_type="nll"`` path computes it;
    - it logs TRL's ``entropy`` and ``mean_token_accuracy`` (from the kept logits; the accuracy counts the first
      argmax, as TRL's kernel does) and ``num_tokens`` (the attention mask's sum, accumulated).

    Not supported, refused at construction with a `ValueError`: ``loss_type="dft"``, label smoothing,
    ``compute_loss_func``, a Mixture-of-Experts auxiliary loss, sequence or context parallelism, more than one
    process (calling the backbone directly bypasses a DDP wrapper, so the gradients would not be synchronised, and
    TRL's ``average_tokens_across_devices`` factor is 1 with one process), a PEFT model, and models whose logits
    are scaled or soft-capped (``logit_scale``, ``final_logit_softcapping``, ...).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.model.config.get_text_config()
        parallelism = self.accelerator.parallelism_config
        unsupported = {
            f'loss_type="{self.args.loss_type}"': self.args.loss_type != "nll",
            "label_smoothing_factor": self.label_smoother is not None,
            "compute_loss_func": self.compute_loss_func is not None,
            "a Mixture-of-Experts auxiliary loss": self.aux_loss_enabled,
            "sequence or context parallelism": parallelism is not None
            and (parallelism.sp_enabled or parallelism.cp_enabled),
            "more than one process": self.accelerator.num_processes > 1,
            "a PEFT model": is_peft_model(self.model),
            "scaled or soft-capped logits": any(getattr(config, name, None) is not None for name in _LOGIT_SCALES),
        }
        if asked := [name for name, on in unsupported.items() if on]:
            raise ValueError(
                f"CompletionSFTTrainer does not support {', '.join(asked)}: use trl.SFTTrainer for that configuration"
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("CompletionSFTTrainer computes no logits to return: evaluate with prediction_loss_only")
        mode = "train" if model.training else "eval"
        labels = inputs["labels"][:, 1:]
        backbone_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        hidden = model.base_model(**backbone_inputs, use_cache=False).last_hidden_state[:, :-1]
        mask = labels != -100
        log_probs = model.get_output_embeddings()(hidden[mask]).float().log_softmax(-1)
        targets = labels[mask]
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        nll = torch.nn.functional.nll_loss(log_probs, targets, reduction="sum")
        loss = nll / torch.as_tensor(num_tokens).clamp(min=1)

        with torch.no_grad():
            num_valid = targets.numel()
            entropy = -(log_probs.exp() * log_probs).sum().item()
            correct = (log_probs.argmax(-1) == targets).sum().item()
        self._metrics[mode]["entropy"].append(entropy / num_valid if num_valid else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / num_valid if num_valid else 0.0)
        if mode == "train":
            # Padding-free batches carry position ids instead of an attention mask, as in `SFTTrainer.compute_loss`
            if "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum())
            else:
                self._total_train_tokens += inputs["position_ids"].size(1)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss
