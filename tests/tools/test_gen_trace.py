"""tools/gen_trace.py: the same trace for the same seed, the Mooncake format, the turn structure of a
conversation (each prompt extends the previous one), the shared system prompt, the CLI."""

from __future__ import annotations

import json

import pytest

from lb.sim import parse_trace
from tools import gen_trace

BT = gen_trace.BLOCK_TOKENS


@pytest.mark.parametrize("shape", sorted(gen_trace.SHAPES))
def test_the_same_seed_gives_the_same_trace_and_another_seed_another(shape):
    sh = gen_trace.SHAPES[shape]
    a, b = gen_trace.generate(sh, 30, seed=5), gen_trace.generate(sh, 30, seed=5)
    assert a == b and a
    assert gen_trace.generate(sh, 30, seed=6) != a


@pytest.mark.parametrize("shape", sorted(gen_trace.SHAPES))
def test_records_are_mooncake_lines_sorted_by_time(shape, tmp_path):
    recs = gen_trace.generate(gen_trace.SHAPES[shape], 40, seed=1)
    path = tmp_path / "t.jsonl"
    gen_trace.write_jsonl(recs, path)
    lines = path.read_text().splitlines()
    assert [list(json.loads(ln)) for ln in lines[:1]] == [["timestamp", "input_length", "output_length", "hash_ids"]]
    parsed = parse_trace(lines)  # the replay's own strict parser takes every line
    assert len(parsed) == len(recs)
    assert [r.timestamp_ms for r in parsed] == sorted(r.timestamp_ms for r in parsed)
    for r in parsed:
        assert len(r.hash_ids) == -(-r.input_length // BT)  # one id per 512-token block, the last partial
        assert 1 <= r.output_length <= gen_trace.SHAPES[shape].max_output
        assert r.input_length <= gen_trace.SHAPES[shape].max_context


@pytest.mark.parametrize("shape", sorted(gen_trace.SHAPES))
def test_each_turn_extends_the_previous_prompt_by_its_answer_and_a_new_message(shape):
    sessions = gen_trace.generate_sessions(gen_trace.SHAPES[shape], 40, seed=2)
    multi = [s for s in sessions if len(s) > 1]
    assert multi, "some sessions have several turns"
    for turns in multi:
        for prev, cur in zip(turns, turns[1:]):
            assert cur["input_length"] > prev["input_length"] + prev["output_length"]  # + a message >= 1 token
            full = prev["input_length"] // BT
            assert cur["hash_ids"][:full] == prev["hash_ids"][:full]  # every full block is shared
            if prev["input_length"] % BT:  # the partial last block held less: a new id at the next turn
                assert cur["hash_ids"][full] != prev["hash_ids"][full]
            assert cur["timestamp"] > prev["timestamp"]


def test_sessions_share_the_system_prompt_blocks_and_nothing_after_them():
    sh = gen_trace.SHAPES["chat"]
    sessions = [s for s in gen_trace.generate_sessions(sh, 60, seed=3) if s]
    sys_blocks = sh.system_tokens // BT
    firsts = [tuple(s[0]["hash_ids"][:sys_blocks]) for s in sessions]
    top = max(set(firsts), key=firsts.count)
    assert firsts.count(top) > len(firsts) / 2  # most sessions open with the first system prompt (weights 1/k)
    assert len(set(firsts)) <= sh.system_prompts
    after = [s[0]["hash_ids"][sys_blocks] for s in sessions if len(s[0]["hash_ids"]) > sys_blocks]
    assert len(set(after)) == len(after)  # the first message differs per session: its block never matches


def test_long_and_short_sessions_are_mixed():
    sh = gen_trace.SHAPES["mixed"]
    sessions = gen_trace.generate_sessions(sh, 200, seed=4)
    firsts = [s[0]["input_length"] - sh.system_tokens for s in sessions if s]
    docs = sum(1 for n in firsts if n > 4 * sh.msg_tokens[0])
    assert 0.15 * len(firsts) < docs < 0.5 * len(firsts)  # long_fraction 0.3 open with a document
    lengths = [len(s) for s in sessions]
    assert min(lengths) <= 1 and max(lengths) >= 8


def test_cli_writes_the_file_and_refuses_bad_arguments(tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert gen_trace.main(["--shape", "agent", "--sessions", "5", "--seed", "1", "--out", str(out)]) == 0
    assert out.read_text().splitlines() and "wrote" in capsys.readouterr().out
    assert gen_trace.main(["--shape", "list"]) == 0 and "longdoc" in capsys.readouterr().out
    for argv in (["--shape", "nope", "--out", str(out)], ["--shape", "chat"], ["--shape", "chat", "--sessions", "0",
                                                                             "--out", str(out)]):
        with pytest.raises(SystemExit) as exc:
            gen_trace.main(argv)
        assert exc.value.code == 2
