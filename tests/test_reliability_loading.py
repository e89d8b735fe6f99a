"""Loading saved things fails in one line: hand-edited or damaged agent files, model folders, checkpoints and recipes.

Every case runs the real CLI in process (`mempo_trl.cli.main`), most on a copy of the tiny model corrupted one file
at a time, and expects one `error:` line (exit code 2) naming the file or field; the Hub case runs
`python -m mempo_trl train` with `HF_ENDPOINT` at a closed port of 127.0.0.1 (nothing leaves the machine).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cpu_recipe, free_port, one_error_line

from mempo_trl.cli import main
from mempo_trl.protocol import PROTOCOL_FILE, TurnProtocol


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with a saved turn protocol (one short turn), as training writes it."""
    directory = tmp_path_factory.mktemp("agent") / "agent"
    shutil.copytree(tiny_model_dir, directory)
    TurnProtocol(max_turns=1, max_completion_length=4).save(directory)
    return directory


@pytest.fixture
def damaged(tmp_path, agent_dir):
    """A copy of `agent_dir` to corrupt."""
    return Path(shutil.copytree(agent_dir, tmp_path / "model"))


def ask(model: Path, demo_paths) -> list[str]:
    return ["ask", "Where was Alice born?", "--model_name_or_path", str(model), "--corpus", str(demo_paths.corpus)]


def test_ask_runs_the_undamaged_copy(damaged, demo_paths, capsys):
    import mempo_trl

    mempo_trl.check_model_files(damaged)  # the checks pass a model as saved
    assert main(ask(damaged, demo_paths)) == 0
    assert "1 turns" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ([], "it holds list [], not a JSON object of settings"),
        (None, "it holds NoneType None, not a JSON object of settings"),
        ("x", "it holds str 'x', not a JSON object of settings"),
        ({"max_turns": 2.5}, "max_turns must be an integer, got 2.5."),
        ({"max_turns": True}, "max_turns must be an integer, got True."),
        ({"max_turns": "3"}, "max_turns must be an integer, got '3'."),
        ({"max_turns": None}, "max_turns must be an integer, got None."),
        ({"retrieval_topk": 2.5}, "retrieval_topk must be an integer, got 2.5."),
        ({"max_completion_length": 16.5}, "max_completion_length must be an integer, got 16.5."),
        ({"max_context_tokens": 0}, "max_context_tokens must be a positive integer"),
        ({"instruction": "Q: {question} {other}"}, "instruction may only use the `{question}` placeholder"),
        ({"instruction": "Q {0}: {question}"}, "instruction may only use the `{question}` placeholder, got {0}"),
        ({"instruction": "Q: {question"}, "instruction is not a valid template"),
        ({"system_prompt": 5}, "system_prompt must be a string, got 5."),
        ({"system_prompt": None}, "system_prompt must be a string, got None."),
        ({"context_mode": "sideways"}, "context_mode must be one of ('memory', 'full_history'), got 'sideways'."),
    ],
)
def test_ask_refuses_a_hand_edited_agent_file(damaged, demo_paths, capsys, edit, problem):
    path = damaged / PROTOCOL_FILE
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, **edit} if isinstance(edit, dict) else edit))
    assert main(ask(damaged, demo_paths)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {path}: not a valid turn protocol (") and problem in line, line


def test_ask_refuses_an_environment_protocol_with_a_retriever(damaged, demo_paths, capsys):
    TurnProtocol(max_turns=1, max_completion_length=4).for_environment().save(damaged)
    assert main(ask(damaged, demo_paths)) == 2
    assert one_error_line(capsys).startswith(
        f"error: {damaged / PROTOCOL_FILE}: action 'tool_call' is the protocol of an agent trained on a TRL-style "
        "environment"
    )


def edit_config(**fields):
    def edit(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **fields}))

    return edit


def write(name: str, text: str):
    return lambda model: (model / name).write_text(text)


def cut(name: str, keep: float):
    def edit(model: Path) -> None:
        with (model / name).open("r+b") as f:
            f.truncate(int((model / name).stat().st_size * keep))

    return edit


RESTORE = "restore it from the saved model, or save the model again"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            edit_config(vocab_size=10),
            "{m}/config.json does not match the weights in model.safetensors: "
            "model.embed_tokens.weight has shape (1616, 64) there, (10, 64) by the config",
        ),
        (
            edit_config(hidden_size="big"),
            "{m}/config.json does not describe a model that can be built (Validation "
            "error for field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str (value: 'big'))",
        ),
        (edit_config(num_hidden_layers=5), "{m}/config.json does not describe a model that can be built ("),
        (
            edit_config(dtype="float99"),
            "{m}/config.json: dtype 'float99' is not a torch dtype (float32, bfloat16, ...)",
        ),
        (write("config.json", "[]"), "{m}/config.json holds list, not a JSON object"),
        (
            write("chat_template.jinja", "{% if %}"),
            "the chat template in {m}/chat_template.jinja cannot render a MemPO round (TemplateSyntaxError: ",
        ),
        (
            write("chat_template.jinja", "{{ raise_exception('no tools here') }}"),
            "the chat template in {m}/chat_template.jinja cannot render a MemPO round (TemplateError: no tools here)",
        ),
        (cut("model.safetensors", 0.5), "{m}/model.safetensors is truncated ("),
        (cut("model.safetensors", 0), "{m}/model.safetensors is truncated (0 bytes, shorter than its header)"),
        (lambda model: (model / "tokenizer.json").unlink(), "{m}/tokenizer.json is missing: {m} holds no tokenizer"),
        (write("tokenizer.json", ""), "{m}/tokenizer.json is not valid JSON (Expecting value: line 1 column 1"),
        (write("tokenizer.json", '{"a": 1}'), "{m}/tokenizer.json is not a tokenizer ("),
        (write("tokenizer_config.json", ""), "{m}/tokenizer_config.json is not valid JSON (Expecting value"),
    ],
)
def test_ask_names_the_damaged_file_of_a_model(damaged, demo_paths, capsys, damage, message):
    damage(damaged)
    assert main(ask(damaged, demo_paths)) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: " + message.format(m=damaged)), line
    assert line.endswith("save_pretrained writes them)" if "missing" in message else RESTORE), line


# ------------------------------------------------------------------------------------------ recipes


def alias_bomb(path: Path, levels: int = 3) -> Path:
    """A recipe of `levels` anchored lists, each holding 9 aliases of the one before (9**levels values)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, levels)]
    path.write_text("\n".join([*lines, "use_cpu: true", ""]))
    return path


@pytest.mark.parametrize("command", [["train"], ["build-index"], ["eval"], ["kit", "tiny"]])
def test_every_command_refuses_yaml_aliases_in_its_recipe(tmp_path, capsys, command):
    recipe = alias_bomb(tmp_path / "bomb.yaml")
    assert main([*command, "--config", str(recipe)]) == 2
    assert one_error_line(capsys) == (
        f"error: {recipe}, line 2: the YAML alias *a0 is not allowed in a recipe; write the value out instead"
    )


def test_a_long_error_line_is_cut(capsys):
    assert main(["serve-retriever", "--corpus", "c.jsonl", "--typo", "x" * 100_000]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: unrecognized arguments: --typo xxx") and len(line) < 2100, len(line)
    assert line.endswith("xxx... (98079 more characters cut)"), line[-60:]


# ------------------------------------------------------------------------------------------ checkpoints


def test_resuming_a_checkpoint_of_another_model_names_both(tmp_path, capsys, tiny_model_dir):
    from mempo_trl.kit.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=0, hidden_size=32)
    (tmp_path / "first").mkdir()
    first = cpu_recipe(tmp_path / "first", other, save_strategy="steps", save_steps=1)
    assert main(["train", "--config", str(first)]) == 0
    checkpoint = tmp_path / "first" / "out" / "checkpoint-1"
    (tmp_path / "second").mkdir()
    second = cpu_recipe(tmp_path / "second", tiny_model_dir, max_steps=2, resume_from_checkpoint=str(checkpoint))
    capsys.readouterr()
    assert main(["train", "--config", str(second)]) == 2
    assert one_error_line(capsys) == (
        f"error: checkpoint {checkpoint} holds another model than {tiny_model_dir} (hidden_size 32 there, 64 here; "
        f"see {checkpoint / 'config.json'}). Resume with the model it was trained from (model_name_or_path), or start "
        "a new run."
    )
    assert not (tmp_path / "second" / "out").exists()  # checked before the model was loaded (nothing written)


# ------------------------------------------------------------------------------------------ the Hub


@pytest.mark.parametrize("offline", ["0", "1"])
def test_push_to_hub_with_the_hub_unreachable_fails_before_loading(tmp_path, tiny_model_dir, offline):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: nothing leaves the machine
    recipe = cpu_recipe(tmp_path, tiny_model_dir, push_to_hub=True, hub_model_id="someone/mempo-test")
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": offline, "HF_TOKEN": "", "MEMPO_DEBUG": ""}
    done = subprocess.run(
        [sys.executable, "-m", "mempo_trl", "train", "--config", str(recipe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("error: ") == 1, done.stderr
    reason = "HF_HUB_OFFLINE is set" if offline == "1" else f"{endpoint} cannot be reached ("
    assert f"error: push_to_hub needs the Hugging Face Hub, but {reason}" in done.stderr, done.stderr
    assert "set push_to_hub: false and upload the output directory later" in done.stderr
    assert not (tmp_path / "out").exists()  # before the output directory, let alone the model
