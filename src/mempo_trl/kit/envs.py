"""Two small, seeded, offline tool environments where memory matters, in TRL's `environment_factory` convention.

- `KeyVaultEnv` (tool ``open_box``): a trail of boxes, each holding a code and naming the next box; the answer is
  every code of the trail in order, joined by ``-``. The codes of early boxes must be carried in ``<mem>`` to the
  last turn. The environment sets ``golden_answers`` in ``reset``, so the memory reward has a target.
- `SafeEnv` (tools ``inspect`` and ``enter_code``): some items of a room show a digit; the safe opens with the
  digits of the named items, in order. The environment owns the reward (``get_reward``: 1.0 once the safe is open)
  and exposes no gold answer, so its episodes train on the outcome advantage only.

Each ``reset`` takes a row ``{"seed": int, ...}`` and rebuilds the same task from the same seed;
`key_vault_rows` / `safe_rows` make such rows, and `KIT_ENVIRONMENTS` names both for recipes
(``environment: keyvault``) and ``mempo-trl eval --environment``. `key_vault_oracle` / `safe_oracle` play each
task perfectly from the context alone (what a good memory agent writes), for tests and token accounting;
`OracleGenerator` makes one a `mempo_trl.rollout.GenerateFn`.

Example:
    >>> env = KeyVaultEnv()
    >>> print(env.reset(seed=3, num_boxes=2))
    A vault opens with the codes of a trail of 2 boxes, in the order you find them, joined by '-' (e.g. 123-456). Start with box D4; each box names the next one.
    >>> env.open_box("D4")
    'Box D4 holds code 233. The trail continues at box H7.'
"""

import json
import random
import re


_BOX_LETTERS = "ABCDEFGH"
_ITEMS = ("clock", "painting", "desk", "lamp", "rug", "vase", "mirror", "shelf")


class KeyVaultEnv:
    """A trail of ``num_boxes`` boxes; open them one by one and answer with all their codes (gold: set by reset)."""

    def __init__(self):
        self.boxes: dict[str, tuple[str, str | None]] = {}
        self.golden_answers: list[str] = []

    def reset(self, seed: int, num_boxes: int = 3, **row) -> str:
        """Build the trail of ``seed``; return the task."""
        rng = random.Random(seed)
        names = rng.sample([f"{letter}{digit}" for letter in _BOX_LETTERS for digit in range(1, 10)], num_boxes)
        codes = [str(rng.randint(100, 999)) for _ in names]
        self.boxes = {name: (code, nxt) for name, code, nxt in zip(names, codes, names[1:] + [None])}
        self.golden_answers = ["-".join(codes)]
        return (
            f"A vault opens with the codes of a trail of {num_boxes} boxes, in the order you find them, joined by "
            f"'-' (e.g. 123-456). Start with box {names[0]}; each box names the next one."
        )

    def open_box(self, box: str) -> str:
        """Open a box and read the code inside and the box the trail continues at.

        Args:
            box: the box's name, e.g. "B3".
        """
        name = box.strip().upper()
        if name not in self.boxes:
            return f"There is no box {box}."
        code, nxt = self.boxes[name]
        where = f"The trail continues at box {nxt}." if nxt else "This is the last box of the trail."
        return f"Box {name} holds code {code}. {where}"


class SafeEnv:
    """A room whose items show the digits of a safe's code; the environment owns the reward (no gold answer)."""

    def __init__(self):
        self.digits: dict[str, str] = {}
        self.code = ""
        self.opened = False

    def reset(self, seed: int, num_digits: int = 3, num_items: int = 5, **row) -> str:
        """Build the room of ``seed``; return the task."""
        rng = random.Random(seed)
        items = rng.sample(_ITEMS, num_items)
        keyed = rng.sample(items, num_digits)
        self.digits = {item: str(rng.randint(0, 9)) for item in keyed}
        self.code = "".join(self.digits[item] for item in keyed)
        self.opened = False
        return (
            f"A safe opens with a {num_digits}-digit code: the digits shown by the {', the '.join(keyed)}, in that "
            f"order. The room holds: {', '.join(sorted(items))}. Inspect items, enter the code, then answer 'open'."
        )

    def inspect(self, item: str) -> str:
        """Look closely at one item of the room.

        Args:
            item: the item's name, e.g. "clock".
        """
        name = item.strip().lower()
        if name in self.digits:
            return f"The {name} shows the digit {self.digits[name]}."
        return f"Nothing special about the {name}."

    def enter_code(self, code: str) -> str:
        """Type a code on the safe's keypad.

        Args:
            code: the digits, e.g. "407".
        """
        if code.strip() == self.code:
            self.opened = True
            return "The safe opens."
        return "Wrong code: the safe stays shut."

    def get_reward(self) -> float:
        """1.0 once the safe has been opened, else 0.0."""
        return float(self.opened)


def key_vault_rows(n: int, seed: int = 0, num_boxes: int = 3) -> list[dict]:
    """``n`` `KeyVaultEnv` rows with distinct seeds.

    Example:
        >>> key_vault_rows(2, seed=1)
        [{'seed': 100000, 'num_boxes': 3}, {'seed': 100001, 'num_boxes': 3}]
    """
    return [{"seed": seed * 100_000 + i, "num_boxes": num_boxes} for i in range(n)]


def safe_rows(n: int, seed: int = 0, num_digits: int = 3) -> list[dict]:
    """``n`` `SafeEnv` rows with distinct seeds."""
    return [{"seed": seed * 100_000 + i, "num_digits": num_digits} for i in range(n)]


def _turn(mem: str, think: str, tool: str | None = None, arguments: dict | None = None, answer: str = "") -> str:
    if tool is None:
        return f"<mem>{mem}</mem><think>{think}</think><answer>{answer}</answer>"
    call = json.dumps({"name": tool, "arguments": arguments})
    return f"<mem>{mem}</mem><think>{think}</think><tool_call>{call}</tool_call>"


def _last_mem(context: str) -> str:
    """The last ``<mem>`` block the agent wrote in ``context`` (empty in round 1: the instruction's has no colon)."""
    blocks = [block for block in re.findall(r"<mem>(.*?)</mem>", context, flags=re.S) if ":" in block]
    return blocks[-1] if blocks else ""


def key_vault_oracle(context: str) -> str:
    """The perfect `KeyVaultEnv` turn after ``context`` (a decoded prompt): remember every code in ``<mem>``, open
    the next box, answer after the last one."""
    opened = dict(re.findall(r"(\w+)=(\d+)", _last_mem(context).split("opened:")[-1]))
    results = re.findall(
        r"Box (\w+) holds code (\d+)\. (?:The trail continues at box (\w+)|This is the last box)", context
    )
    nxt = re.search(r"Start with box (\w+)", context).group(1)
    if results:
        box, code, nxt = results[-1]
        opened[box] = code
    mem = "opened: " + " ".join(f"{box}={code}" for box, code in opened.items())
    if results and not nxt:
        return _turn(mem, "That was the last box.", answer="-".join(opened.values()))
    return _turn(mem, f"Open box {nxt}.", "open_box", {"box": nxt})


def safe_oracle(context: str) -> str:
    """The perfect `SafeEnv` turn after ``context``: remember every digit in ``<mem>``, inspect the named items in
    order, enter the code, answer once the safe is open."""
    keyed = re.search(r"the digits shown by the (.*?), in that order", context).group(1).split(", the ")
    digits = dict(re.findall(r"(\w+)=(\d)", _last_mem(context).split("digits:")[-1]))
    seen = re.findall(r"The (\w+) shows the digit (\d)\.", context)
    if seen:
        digits[seen[-1][0]] = seen[-1][1]
    mem = "digits: " + " ".join(f"{item}={digits[item]}" for item in keyed if item in digits)
    if "The safe opens." in context:
        return _turn(mem, "The safe is open.", answer="open")
    missing = [item for item in keyed if item not in digits]
    if missing:
        return _turn(mem, f"Inspect the {missing[0]}.", "inspect", {"item": missing[0]})
    code = "".join(digits[item] for item in keyed)
    return _turn(mem, "I have every digit.", "enter_code", {"code": code})


class OracleGenerator:
    """A `mempo_trl.rollout.GenerateFn` that answers each prompt with ``policy(decoded prompt)``, tokenized."""

    def __init__(self, tokenizer, policy):
        self.tokenizer = tokenizer
        self.policy = policy
        self.eos_token_ids = [tokenizer.eos_token_id]

    def __call__(self, prompts: list[list[int]]) -> tuple[list[list[int]], None]:
        texts = [self.policy(self.tokenizer.decode(ids, skip_special_tokens=False)) for ids in prompts]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts], None


KIT_ENVIRONMENTS = {"keyvault": (KeyVaultEnv, key_vault_rows), "safe": (SafeEnv, safe_rows)}
"""Kit environments by name: ``(environment class, rows(n, seed) function)``."""

ORACLES = {"keyvault": key_vault_oracle, "safe": safe_oracle}
"""The perfect policy of each kit environment, by name."""
