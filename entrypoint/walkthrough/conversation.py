"""The running example: a coding agent's conversation, as token ids.

Turn 1: system prompt, tool definitions, the user's task.
Turn 2: turn 1, the model's reply, a tool call, the tool's result and a
        screenshot (an image segment), then the model continues.
Turn 3: the whole history plus a new user message. It shares everything but
        the new message with turn 2, so nearly all of its prefill should come
        from the store.

Text becomes token ids through a byte-level tokenizer (one id per byte, folded
into the model's vocabulary), which keeps the example readable without a
tokenizer download. ``context_tokens`` scales the example: the tool
definitions and the tool result grow to fill it, as they do in real agent
traffic.

The prompts of turns 2 and 3 hold the model's earlier replies: ``turn2_prompt``
and ``turn3_prompt`` build them (the walkthrough sends nothing else), and
``request_sizes`` gives their lengths before anything runs, with replies of
``max_new_tokens`` tokens each (the entrypoint streams exactly that many).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvstore.keys import image_hash

SYSTEM = ("You are a coding agent. You read the repository, run tools, and edit files. "
          "Answer with a short plan, then call tools. Never guess a file's content: read it. ")
TOOLS = ('{"name": "read_file", "parameters": {"path": "string"}} '
         '{"name": "run_tests", "parameters": {"target": "string"}} '
         '{"name": "apply_patch", "parameters": {"patch": "string"}} '
         '{"name": "screenshot", "parameters": {"url": "string"}} ')
TASK = "User: the checkout page renders the total twice. Find the bug and fix it. "
TOOL_CALL = 'Assistant: calling screenshot {"url": "http://localhost:8080/checkout"} and read_file. '
TOOL_RESULT = "Tool read_file(src/checkout/total.py): def render_total(cart): return fmt(cart.total) + fmt(cart.total) "
NEW_MESSAGE = "User: good catch. Also add a regression test for the duplicated total, then run the tests. "


def tokenize(text: str, vocab_size: int) -> list[int]:
    """Byte-level ids folded into ``[1, vocab_size)`` (0 is kept free)."""
    return [1 + (b % (vocab_size - 1)) for b in text.encode("utf-8")]


def _fill(text: str, n_chars: int) -> str:
    if n_chars <= len(text):
        return text
    reps = n_chars // len(text) + 1
    return "".join(f"[{i}] {text}" for i in range(reps))[:n_chars]


@dataclass(frozen=True, slots=True)
class Image:
    data: bytes
    start: int
    length: int

    @property
    def hash(self) -> bytes:
        return image_hash(self.data)


@dataclass(frozen=True, slots=True)
class Conversation:
    turn1: list[int]
    turn2_added: list[int]  # tool call + tool result + screenshot placeholder, after turn 1's reply
    turn3_added: list[int]  # the new user message, after turn 2's reply
    screenshot: Image  # position relative to the start of turn2_added
    vocab_size: int

    def turn2_prompt(self, reply1: list[int]) -> list[int]:
        """Turn 2's prompt after turn 1's reply ``reply1``."""
        return self.turn1 + reply1 + self.turn2_added

    def screenshot_start(self, reply1: list[int]) -> int:
        """Where the screenshot starts in ``turn2_prompt(reply1)`` (and in turn 3's prompt)."""
        return len(self.turn1) + len(reply1) + self.screenshot.start

    def turn3_prompt(self, turn2_prompt: list[int], reply2: list[int]) -> list[int]:
        """Turn 3's prompt after turn 2's prompt and its reply ``reply2``."""
        return turn2_prompt + reply2 + self.turn3_added

    def request_sizes(self, max_new_tokens: int) -> "RequestSizes":
        """The prompt lengths the walkthrough sends, each reply ``max_new_tokens`` tokens long."""
        reply = [0] * max_new_tokens
        p2 = self.turn2_prompt(reply)
        return RequestSizes(len(self.turn1), len(p2), len(self.turn3_prompt(p2, reply)), max_new_tokens)


@dataclass(frozen=True, slots=True)
class RequestSizes:
    """Prompt lengths (tokens) of the walkthrough's three turns, and the new tokens each asks for."""

    turn1: int
    turn2: int
    turn3: int
    max_new_tokens: int

    @property
    def longest(self) -> int:
        """Prompt plus new tokens of the longest request (turn 3): what one engine must hold."""
        return self.turn3 + self.max_new_tokens


def build(context_tokens: int, vocab_size: int, *, image_tokens: int = 64) -> Conversation:
    """A conversation whose turn 3 has about ``context_tokens`` tokens of prompt."""
    budget = max(context_tokens, 600)
    # Shares of the context: system prompt 10%, tool definitions 40%, the tool's result the rest
    # (less the fixed texts, the image and the two replies).
    t1 = _fill(SYSTEM, int(budget * 0.10)) + _fill(TOOLS, int(budget * 0.40)) + TASK
    before_img = TOOL_CALL
    after_img = _fill(TOOL_RESULT, int(budget * 0.50) - image_tokens - 256)
    placeholder = "\0" * image_tokens  # overwritten by the vision encoder's tokens
    t2 = before_img + placeholder + after_img
    shot = hashlib.shake_256(b"checkout-page-screenshot").digest(48 * 1024)  # deterministic image bytes
    return Conversation(
        turn1=tokenize(t1, vocab_size),
        turn2_added=tokenize(t2, vocab_size),
        turn3_added=tokenize(NEW_MESSAGE, vocab_size),
        screenshot=Image(shot, len(before_img.encode()), image_tokens),
        vocab_size=vocab_size,
    )
