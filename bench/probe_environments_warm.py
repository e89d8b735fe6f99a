"""Probe for the closing note of issue 25: SFT-warm-start the tiny model on the oracle turns of a kit environment.

Plays 300 seeded rows (seed 0) with the oracle through the real `RolloutEngine` (memory contexts), fine-tunes the tiny
model on one (prompt, completion) pair per round (AdamW, lr 5e-3, batch 16, one thread), saves it into OUTPUT_DIR
and evaluates it greedily on 20 held-out rows (seed 1).

    python bench/probe_environments_warm.py keyvault 600 /tmp/envs_warm_kv
"""

import sys
import time
from pathlib import Path

import torch

from mempo_trl.context import TurnProtocol
from mempo_trl.environments import TOOL_STOPS
from mempo_trl.generation import HFGenerator
from mempo_trl.kit.envs import KIT_ENVIRONMENTS, ORACLES, OracleGenerator
from mempo_trl.kit.tiny import build_tiny_model, load_tiny
from mempo_trl.padding import pad_ids
from mempo_trl.rollout import RolloutEngine


name = sys.argv[1]
steps = int(sys.argv[2])
out = Path(sys.argv[3])
torch.manual_seed(0)
torch.set_num_threads(1)
d = build_tiny_model(out, seed=0)
model, tok = load_tiny(d)
cls, rows_fn = KIT_ENVIRONMENTS[name]
eng = RolloutEngine(tok, TurnProtocol(max_turns=8), environment_factory=cls, eos_token_ids=[tok.eos_token_id])
eps, _ = eng.run(rows_fn(300, seed=0), OracleGenerator(tok, ORACLES[name]))
eos = tok.convert_tokens_to_ids("<|im_end|>")
ex = [(r.prompt_ids, r.completion_ids + [eos]) for ep in eps for r in ep.rounds]
print("examples", len(ex), "mean len", sum(len(p) + len(c) for p, c in ex) / len(ex), flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * (1.0 - s / steps))
g = torch.Generator().manual_seed(0)
model.train()
t0 = time.time()
for step in range(steps):
    idx = torch.randint(len(ex), (16,), generator=g).tolist()
    batch = [ex[i] for i in idx]
    ids, att = pad_ids([p + c for p, c in batch], 0)
    labels, _ = pad_ids([[-100] * len(p) + c for p, c in batch], -100)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    keep = max(len(c) for _, c in batch) + 1
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False, logits_to_keep=keep).logits[
        :, :-1
    ]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1 - keep :].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    if step % 50 == 0 or step == steps - 1:
        print(step, round(loss.item(), 3), round(time.time() - t0, 1), flush=True)
model.save_pretrained(d)
tok.save_pretrained(d)
model.eval()
gen = HFGenerator(model, tok, max_new_tokens=96, stops=TOOL_STOPS)
eng2 = RolloutEngine(tok, TurnProtocol(max_turns=8), environment_factory=cls, eos_token_ids=gen.eos_token_ids)
eps, _ = eng2.run(rows_fn(20, seed=1), gen)
m = [ep.metrics() for ep in eps]
print({k: sum(x.get(k, 0) for x in m) / len(m) for k in m[0]})
print(eps[0].rounds[0].text)
print(eps[0].rounds[-1].text)
print("reward", [getattr(ep.environment, "opened", None) for ep in eps][:10])
