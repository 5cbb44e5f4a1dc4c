"""Streaming output (text appears while decoding goes on) and `spd-infer chat` through a pipe."""

import json
import os
import signal
import subprocess
import sys
import time

from transformers import AutoTokenizer

from spd.cli import main
from spd.targets.tiny import save_tiny_target
from launch import run_python

CLI = [sys.executable, "-m", "spd.cli"]


def test_text_streams_before_decoding_ends(capsys, tiny_target_dir, tmp_path):
    args = [f"target={tiny_target_dir}", "Tell me a story", "n=3", "max_new_tokens=160"]
    assert main(["generate", *args, "json=true"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert expected["N"] == 160  # long enough that the stream is visibly ahead of the end
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([*CLI, "generate", *args], stdout=subprocess.PIPE, stderr=err)
        first = os.read(proc.stdout.fileno(), 1)  # blocks until the first verified text is printed
        still_running = proc.poll() is None
        stats_yet = "[spd n=3 local, module]" in err_path.read_text()
        rest = proc.stdout.read()
        proc.wait(timeout=300)
    assert first and still_running and not stats_yet
    assert proc.returncode == 0
    assert (first + rest).decode() == expected["text"] + "\n"
    lines = err_path.read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[spd n=3 local, module] N=160")


def chat(target, text, *args):
    proc = run_python([*CLI[1:], "chat", f"target={target}", "max_new_tokens=12", "n=3", *args], input=text,
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def template(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def test_chat_keeps_the_conversation(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    proc = chat(tiny_target_dir, "Hi there\nWhat is 2+2?\n/exit\nnever read\n", "json=true")
    first, second = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert first["prompt_token_ids"] == template(tok, [{"role": "user", "content": "Hi there"}])
    assert second["prompt_token_ids"] == template(tok, [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "What is 2+2?"}])


def test_chat_streams_text_with_a_stats_line_per_answer(tiny_target_dir):
    proc = chat(tiny_target_dir, "Hi there\n\nWhat is 2+2?\n")  # an empty line is skipped; end of input leaves
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[spd n=3 local, module]")]
    assert len(stats) == 2 and len(proc.stderr.strip().splitlines()) == 2
    assert proc.stdout.count("\n") >= 2


def test_chat_reset_and_context_overflow(tiny_target_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    proc = chat(tiny_target_dir, "first\n/reset\nsecond\n", "json=true")
    answers = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert answers[1]["prompt_token_ids"] == template(tok, [{"role": "user", "content": "second"}])
    # A 96-token window: 40 new tokens per answer leave no room for the first exchange in the second turn.
    short = tmp_path / "short_window"
    save_tiny_target(str(short), "llama", seed=0, max_position_embeddings=96)
    proc = chat(str(short), "first\nsecond\n", "json=true", "max_new_tokens=40")
    answers = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(answers[0]["token_ids"]) == 40 and len(answers[0]["prompt_token_ids"]) + 2 * 40 > 96
    assert "oldest exchange is forgotten" in proc.stderr
    assert answers[1]["prompt_token_ids"] == template(tok, [{"role": "user", "content": "second"}])


def test_chat_refuses_a_prompt_and_leaves_on_ctrl_c(tiny_target_dir):
    proc = run_python([*CLI[1:], "chat", f"target={tiny_target_dir}", "Hi"], timeout=120)
    assert proc.returncode == 2 and "standard input" in proc.stderr
    # A child that starts with SIGINT ignored never gets Python's KeyboardInterrupt handler (and then rightly
    # ignores Ctrl-C, as under nohup). In full runs only, this test has seen the chat exit 0 after SIGINT, which is
    # what an ignored SIGINT inherited from the test process would do; so the child starts the way a terminal
    # starts it, SIGINT at its default.
    proc = subprocess.Popen([*CLI, "chat", f"target={tiny_target_dir}", "max_new_tokens=4"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stdin.write("Hi\n")
    proc.stdin.flush()
    assert proc.stderr.readline().startswith("[suffix m=15 W=4 tree_nodes=16, the default here]")  # an answer is done: it waits for the next line
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == "spd-infer: interrupted"
