"""kvstore.keys: the hash chain's properties (hypothesis) and its misuse errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequest
from kvstore.keys import KEY_LEN, BlockHasher, ImageSpan, Namespace, check_key, check_keys

NS = Namespace("m", "global", "bfloat16", 0)
tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200)


@given(tokens, st.integers(0, 200))
@settings(max_examples=60, deadline=None)
def test_prefix_of_tokens_gives_prefix_of_keys(toks, cut):
    h = BlockHasher(NS, 8)
    full = h.hash_blocks(toks)
    assert h.hash_blocks(toks[:cut]) == full[: cut // 8]
    assert all(len(k) == KEY_LEN for k in full)


@given(tokens.filter(lambda t: len(t) >= 16), st.data())
@settings(max_examples=60, deadline=None)
def test_any_change_changes_that_block_and_all_later(toks, data):
    h = BlockHasher(NS, 8)
    i = data.draw(st.integers(0, len(toks) - 1))
    changed = list(toks)
    changed[i] = (changed[i] + 1) % 2**32
    a, b = h.hash_blocks(toks), h.hash_blocks(changed)
    blk = i // 8
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:]))


@given(tokens.filter(lambda t: len(t) >= 8), st.binary(min_size=1, max_size=8))
@settings(max_examples=40, deadline=None)
def test_salts_and_namespaces_separate(toks, salt):
    a = BlockHasher(NS, 8, b"tenant-a").hash_blocks(toks)
    b = BlockHasher(NS, 8, b"tenant-a" + salt).hash_blocks(toks)
    c = BlockHasher(Namespace("m", "global", "bfloat16", 1), 8, b"tenant-a").hash_blocks(toks)
    assert not set(a) & set(b)
    assert not set(a) & set(c)


def test_partial_last_block_is_never_hashed():
    h = BlockHasher(NS, 16)
    assert h.hash_blocks(list(range(31))) == h.hash_blocks(list(range(16)))
    assert len(h.hash_blocks(list(range(15)))) == 0


def test_images_enter_only_the_blocks_they_overlap():
    h = BlockHasher(NS, 16)
    toks = [7] * 64
    plain = h.hash_blocks(toks)
    img = h.hash_blocks(toks, [ImageSpan(b"img-1", start=20, length=8)])  # inside block 1
    other = h.hash_blocks(toks, [ImageSpan(b"img-2", start=20, length=8)])
    assert img[0] == plain[0] and img[1] != plain[1] and img[1] != other[1]


def test_continuing_a_chain_matches_hashing_at_once():
    h = BlockHasher(NS, 8)
    toks = list(range(80))
    full = h.hash_blocks(toks)
    tail = h.hash_blocks(toks[40:], parent=full[4], start_block=5)
    assert full[5:] == tail


def test_stable_across_processes():
    code = (
        "from kvstore.keys import *;"
        "print(BlockHasher(Namespace('m','global','bfloat16',0),8,b's').hash_blocks(list(range(24)))[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    here = BlockHasher(NS, 8, b"s").hash_blocks(list(range(24)))[-1].hex()
    assert out == here


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17, "not-bytes", 5])
def test_wrong_key_length_is_a_clear_error(bad):
    with pytest.raises(InvalidRequest, match="16 bytes|must be bytes"):
        check_key(bad)


_key_like = st.one_of(st.binary(min_size=KEY_LEN, max_size=KEY_LEN), st.binary(max_size=20),
                      st.binary(min_size=KEY_LEN, max_size=KEY_LEN).map(bytearray), st.text(max_size=16),
                      st.integers(), st.none())


@given(st.lists(_key_like, max_size=12))
@settings(max_examples=200, deadline=None)
def test_a_batch_of_keys_is_checked_as_each_key_is(batch):
    """``check_keys`` (one fast pass when all are valid) answers as ``check_key`` per key."""
    try:
        want = [check_key(k) for k in batch]
    except InvalidRequest:
        with pytest.raises(InvalidRequest):
            check_keys(batch)
        return
    got = check_keys(batch)
    assert got == want and all(type(k) is bytes for k in got)


def test_bad_hasher_inputs():
    with pytest.raises(InvalidRequest):
        BlockHasher(NS, 0)
    with pytest.raises(InvalidRequest):
        Namespace("")
    with pytest.raises(InvalidRequest):
        ImageSpan(b"h", start=-1, length=3)
    with pytest.raises(InvalidRequest):
        BlockHasher(NS, 8).hash_blocks([-1] * 8)
