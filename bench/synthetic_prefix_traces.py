#!/usr/bin/env python3
"""Seeded Mooncake-format traces for checking a policy away from the Mooncake trace.

    python bench/synthetic_prefix_traces.py two_turn_chat > /tmp/two_turn.jsonl
    python bench/synthetic_prefix_traces.py zipf_docs_scan > /tmp/zipf_scan.jsonl
    kvbroker replay --trace /tmp/two_turn.jsonl --format mooncake --no-decode --hbm 20000tok,60000tok,200000tok --policies lru,adaptive

- ``two_turn_chat``: 3,000 conversations, each a first prompt of 4-40 new blocks and, a
  gap of 0-400 requests later (uniform), a second prompt that reuses the whole first one
  plus 1-4 new blocks; never a third. Every block is reused once at most: the workload
  where keeping "blocks reused before" first is worthless and recency is all there is.
- ``zipf_docs_scan``: 400 documents of 8-64 blocks with Zipf(0.9) popularity, each prompt a
  document plus a one-block question; one prompt in three is instead a one-time scan of
  20-120 new blocks. Frequency matters; scans must not flush the popular documents.
- ``multi_turn_chat``: sessions of growing context (each turn's request is the last one's
  plus its answer and a new message) over a few shared system prompts, conversations
  Zipf-popular (see ``multi_turn_chat``'s docstring for every parameter). About 10k
  requests and 270k chunks asked at the defaults. ``--seed N`` draws another.
- ``long_gap_chat``: chat whose conversations come back long after their last turn (an
  exponential 1,500 requests later), a Pareto-distributed number of turns, one shared
  system chunk: a 1M-token tier holds under a hundred requests, LRU finds little but the
  system chunk and frequency with a long memory decides (see ``long_gap_chat``'s
  docstring). About 10k requests and 226k chunks asked.
- ``returning_chat``: ``long_gap_chat`` as the public Mooncake conversation trace looks:
  turns a few hundred requests apart (log-normal, median 400), each adding 1-20 chunks;
  LRU finds 4% of its chunks at 1M tokens, a policy with memory more than twice that
  (see ``returning_chat``'s docstring). About 8k requests and 272k chunks asked.
- ``synthetic_first_half`` / ``synthetic_second_half``: the first and the second half of
  tests/data/mooncake/synthetic_trace.jsonl (its lines unchanged).

Nothing here was fitted to a policy: the first two are the extremes a prefix cache sees,
the third the traffic of a chat service. ``python bench/synthetic_prefix_traces.py
multi_turn_chat --seed 2 > /tmp/mtc2.jsonl``; in Python, each generator yields the requests'
hash-id lists and ``mooncake_lines`` makes them Mooncake JSONL lines.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

SYNTHETIC_TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"


def two_turn_chat(seed: int = 1) -> Iterator[list[int]]:
    rng = random.Random(seed)
    next_id = 0
    pending: list[tuple[int, list[int]]] = []  # (request index due, prompt to extend)
    request = 0
    conversations = 3000
    started = 0
    while started < conversations or pending:
        due = [p for p in pending if p[0] <= request]
        if due:
            pending.remove(due[0])
            prompt = due[0][1] + list(range(next_id, next_id + rng.randint(1, 4)))
            next_id = prompt[-1] + 1
        elif started < conversations:
            prompt = list(range(next_id, next_id + rng.randint(4, 40)))
            next_id = prompt[-1] + 1
            pending.append((request + rng.randint(0, 400), prompt))
            started += 1
        else:
            pending.sort()
            request = pending[0][0]
            continue
        yield prompt
        request += 1


def zipf_docs_scan(seed: int = 1) -> Iterator[list[int]]:
    rng = random.Random(seed)
    docs = 400
    next_id = 0
    chains = []
    for _ in range(docs):
        n = rng.randint(8, 64)
        chains.append(list(range(next_id, next_id + n)))
        next_id += n
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(docs)]
    for _ in range(6000):
        if rng.random() < 1 / 3:
            n = rng.randint(20, 120)
            yield list(range(next_id, next_id + n))
        else:
            doc = rng.choices(range(docs), weights)[0]
            yield [*chains[doc], next_id]
            n = 1
        next_id += n


def multi_turn_chat(
    seed: int = 1,
    *,
    conversations: int = 4000,
    conversation_zipf: float = 1.0,
    window_turns: float = 6.5,
    system_prompts: int = 8,
    system_zipf: float = 1.0,
    system_chunks: tuple[int, int] = (2, 12),
    user_chunks: tuple[int, int] = (1, 6),
    answer_chunks: tuple[int, int] = (0, 2),
    max_context_chunks: int = 72,
    think_requests: float = 1000.0,
) -> Iterator[list[int]]:
    """Multi-turn chat: sessions of growing context over shared system prompts.

    - ``system_prompts`` prompts of ``system_chunks`` chunks (uniform), their popularity
      Zipf(``system_zipf``); each of the ``conversations`` is bound to one, drawn by it.
    - Conversation popularity is Zipf(``conversation_zipf``) over the conversations' ranks
      (conversation 0 the most popular): a conversation's turns inside the trace are
      geometric (from 0: the least popular often never appear) with mean
      ``window_turns * conversations * its share of the popularity``, so the trace holds
      about ``window_turns * conversations`` turns before the context limit cuts.
    - Turn k's request is the system prompt, the whole conversation so far (every earlier
      user message and answer) and the new user message of ``user_chunks`` chunks; its
      answer of ``answer_chunks`` chunks joins the context of turn k+1. A conversation's
      chunk ids never change, so each turn extends the last one's request. A conversation
      ends at its drawn number of turns, or earlier when the next request would exceed
      ``max_context_chunks`` (the model's context window: 72 chunks of 512 tokens).
    - Arrivals interleave: time counts in slots, the expected turns span
      ``window_turns * conversations`` of them; a conversation's first turn comes at a
      uniform slot of that span, each next one an exponential ``think_requests`` slots
      later (mean: the user's think time, long enough that other conversations' turns
      come between); requests are yielded in time order.

    Ids: system prompt chunks first, then each conversation's chunks as drawn.
    """
    rng = random.Random(seed)
    next_id = 0
    prompts: list[list[int]] = []
    for _ in range(system_prompts):
        n = rng.randint(*system_chunks)
        prompts.append(list(range(next_id, next_id + n)))
        next_id += n
    prompt_weights = [1.0 / (rank + 1) ** system_zipf for rank in range(system_prompts)]
    weights = [1.0 / (rank + 1) ** conversation_zipf for rank in range(conversations)]
    total = sum(weights)
    horizon = window_turns * conversations
    # (time, conversation, turn): when each request arrives; the chunks of each
    # conversation's last request (every earlier one is a prefix of it) and each turn's length.
    arrivals: list[tuple[float, int, int]] = []
    contexts: list[list[int]] = []
    lengths: list[list[int]] = []
    for c in range(conversations):
        mean = window_turns * conversations * weights[c] / total
        go_on = mean / (1.0 + mean)  # a geometric from 0 with this mean
        context = list(prompts[rng.choices(range(system_prompts), prompt_weights)[0]])
        ends: list[int] = []
        at = rng.uniform(0.0, horizon)
        while rng.random() < go_on:
            user = rng.randint(*user_chunks)
            if len(context) + user > max_context_chunks:
                break
            context.extend(range(next_id, next_id + user))
            next_id += user
            ends.append(len(context))
            arrivals.append((at, c, len(ends) - 1))
            answer = rng.randint(*answer_chunks)
            context.extend(range(next_id, next_id + answer))
            next_id += answer
            at += rng.expovariate(1.0 / think_requests)
        contexts.append(context)
        lengths.append(ends)
    arrivals.sort()
    for _, c, turn in arrivals:
        yield contexts[c][: lengths[c][turn]]


def long_gap_chat(
    seed: int = 1,
    *,
    conversations: int = 12000,
    first_chunks: float = 10.0,
    extra_turns: float = 1.0,
    gap_requests: float = 1500.0,
    gap_sigma: float | None = None,
    added_chunks: tuple[int, int] = (2, 4),
) -> Iterator[list[int]]:
    """Chat whose conversations come back long after their last turn, over one shared block.

    The shape of a public multi-turn service's trace, where a prefix cache of 1M tokens
    holds under a hundred requests and LRU finds little but the system prompt:

    - every request starts with chunk 0 (one shared system prompt chunk);
    - a conversation's first prompt has a log-normal number of new chunks (median
      ``first_chunks``, sigma 1, 1 to 240);
    - its number of further turns is geometric with a mean drawn per conversation from a
      Pareto(1.5) law scaled to ``extra_turns`` on average: most conversations have none or
      one, a few have many (the popular ones, whose prefixes frequency keeps);
    - a further turn repeats the last prompt but its final chunk (a partial chunk, which
      the next turn's longer text hashes anew) and adds 2 to 4 new chunks (that chunk
      rehashed, the answer and the new message), an exponential ``gap_requests`` requests
      after the last turn (mean); conversations start uniformly over twice the trace's
      span, ending where it ends, and the trace is the requests of its span (a steady state).

    ``gap_sigma`` set: the gaps are log-normal instead, median ``gap_requests``, that sigma;
    ``added_chunks``: the range of new chunks a further turn adds (``returning_chat``).
    """
    rng = random.Random(seed)
    next_id = 1
    horizon = conversations * (1.0 + extra_turns)
    arrivals: list[tuple[float, int, list[int]]] = []
    for c in range(conversations):
        mean = extra_turns * (rng.paretovariate(1.5) - 1.0) / 2.0  # Pareto(1.5) - 1 has mean 2
        go_on = mean / (1.0 + mean)
        n = min(240, max(1, int(rng.lognormvariate(math.log(first_chunks), 1.0))))
        prompt = [0, *range(next_id, next_id + n)]
        next_id += n
        at = rng.uniform(-horizon, horizon)
        arrivals.append((at, c, prompt))
        while rng.random() < go_on and at < horizon:
            added = rng.randint(*added_chunks)
            if len(prompt) - 1 + added > 240:
                break  # the context window (240 chunks of 512 tokens)
            prompt = [*prompt[:-1], *range(next_id, next_id + added)]
            next_id += added
            at += rng.expovariate(1.0 / gap_requests) if gap_sigma is None else rng.lognormvariate(math.log(gap_requests), gap_sigma)
            arrivals.append((at, c, prompt))
    # Steady state: conversations start before the trace does, and the trace is the
    # requests inside its span.
    arrivals = sorted((a for a in arrivals if 0.0 <= a[0] < horizon), key=lambda a: (a[0], a[1]))
    for _, _, prompt in arrivals:
        yield prompt


def returning_chat(seed: int = 1) -> Iterator[list[int]]:
    """Chat whose conversations come back a few hundred requests after their last turn,
    each turn adding 1 to 20 chunks: ``long_gap_chat`` with log-normal gaps (median 400
    requests, sigma 0.5) over 9,000 conversations.

    The shape read off the public Mooncake conversation trace (kvcache-ai/Mooncake,
    FAST25-release/traces/conversation_trace.jsonl; not in the project): its continuing
    requests repeat an earlier prompt and add a turn of 1 to 23 chunks, the turns of one
    conversation a few hundred requests apart (at about 24 chunks a request, beyond a
    1M-token tier's reach), and about half the requests continue a conversation. LRU then
    finds little but the shared first chunk (4% of chunks at 1,953 chunks here; the
    public trace: 5.3% through vLLM's manager), and a policy that remembers what came back
    finds the rest."""
    return long_gap_chat(seed, conversations=9000, gap_requests=400.0, gap_sigma=0.5, added_chunks=(1, 20))


def synthetic_half(which: int, path: Path = SYNTHETIC_TRACE) -> list[str]:
    """Half ``which`` (0: the first, 1: the second) of a Mooncake trace's lines, unchanged.
    The second half holds the odd line (the synthetic trace's: lines 1,997-3,993, the split
    docs/policies.md's held-out checks use)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    middle = len(lines) // 2
    return lines[:middle] if which == 0 else lines[middle:]


def synthetic_first_half(seed: int = 1) -> Iterator[list[int]]:
    """The first half of the Mooncake synthetic trace (``seed`` is ignored: nothing is drawn)."""
    return (json.loads(line)["hash_ids"] for line in synthetic_half(0))


def synthetic_second_half(seed: int = 1) -> Iterator[list[int]]:
    """The second half of the Mooncake synthetic trace (``seed`` is ignored)."""
    return (json.loads(line)["hash_ids"] for line in synthetic_half(1))


def mooncake_lines(requests: Iterable[list[int]]) -> Iterator[str]:
    """Mooncake JSONL lines of hash-id lists, one request per millisecond."""
    for i, hashes in enumerate(requests):
        yield json.dumps({"timestamp": i, "input_length": 512 * len(hashes), "output_length": 1, "hash_ids": hashes})


GENERATORS = {
    "two_turn_chat": two_turn_chat,
    "zipf_docs_scan": zipf_docs_scan,
    "multi_turn_chat": multi_turn_chat,
    "long_gap_chat": long_gap_chat,
    "returning_chat": returning_chat,
    "synthetic_first_half": synthetic_first_half,
    "synthetic_second_half": synthetic_second_half,
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Print a seeded Mooncake-format trace (JSONL) on stdout.")
    ap.add_argument("trace", choices=sorted(GENERATORS))
    ap.add_argument("--seed", type=int, default=1, help="the generator's seed (default 1)")
    args = ap.parse_args(argv)
    if args.trace.startswith("synthetic_"):
        lines: Iterable[str] = synthetic_half(0 if args.trace.endswith("first_half") else 1)
    else:
        lines = mooncake_lines(GENERATORS[args.trace](args.seed))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
