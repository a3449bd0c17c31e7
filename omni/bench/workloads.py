"""Workloads shared by the `omni bench` engine benchmarks (seeded, reproducible)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

NAMES = ["John Doe", "Jane Smith", "Alice Johnson", "Bob Brown", "Carol White", "Dave Green",
         "Emma Black", "Frank Blue", "Grace Yellow", "Henry Violet", "Irene Orange", "Jack Indigo",
         "Karen Red", "Leo Brown", "Mia Green", "Noah Yellow", "Olivia Blue", "Peter Black"]
JOBS = ["Engineer", "Doctor", "Teacher", "Artist", "Scientist", "Lawyer", "Musician", "Chef"]
COUNTRIES = ["USA", "Canada", "UK", "Australia", "New Zealand", "Ireland"]


def long_document(tokenizer, target_tokens: int = 2000, seed: int = 0) -> str:
    """A markdown table of people (as in the long-document QA example), ~target_tokens long."""
    rng = random.Random(seed)
    head = ("You are a helpful assistant that reads tables in markdown format. Here is a table.\n"
            "| ID | Name | Age | Occupation | Country | Email | Phone |\n|---|---|---|---|---|---|---|\n")
    rows, i = [], 1
    while True:
        name = rng.choice(NAMES)
        rows.append(f"| {i} | {name} | {rng.randint(20, 60)} | {rng.choice(JOBS)} | {rng.choice(COUNTRIES)} | "
                    f"{name.split()[0].lower()}.{i}@example.com | 555-{rng.randint(1000, 9999)} |\n")
        i += 1
        if i % 10 == 0 and len(tokenizer(head + "".join(rows))["input_ids"]) >= target_tokens:
            return head + "".join(rows)


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"\nQuestion: what is the age of {rng.choice(NAMES)}? Answer: The age is" for _ in range(n)]


@dataclass
class ThroughputRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def throughput_requests(num: int, vocab_size: int, seed: int = 0, min_prompt: int = 32,
                        max_prompt: int = 512, min_out: int = 16, max_out: int = 128) -> list[ThroughputRequest]:
    rng = random.Random(seed)
    return [ThroughputRequest([rng.randrange(100, vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))],
                              rng.randint(min_out, max_out)) for _ in range(num)]


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
