"""Simulated workloads: how many requests, how long their prompts and outputs are, when they
arrive (open loop) or how many each rank keeps in flight (closed loop), and which of them share
a prompt prefix.

Lengths are written as small strings (``LengthSpec.parse``)::

    2000  or  fixed:2000         every request exactly 2000 tokens
    uniform:1000-3000            integers drawn uniformly from [1000, 3000], both ends included
    normal:2000,200              normal with mean 2000 and standard deviation 200
    lognormal:2000,0.5           log-normal with mean 2000 and sigma 0.5 of the log
                                 (a long right tail, like real chat prompts)

Drawn lengths are rounded and clipped to at least 1 token.

Prompts are real token-id sequences, so the engine's prefix cache hashes and shares them as it
would real prompts: the requests of prefix group ``g`` start with the same ``prefix_len``
random ids, and every prompt ends with ids of its own. They are *not* stored as lists: a wide
deployment keeps tens of millions of prompt tokens in flight (144 ranks x 256 requests x 2,000
tokens = 74M ids, ~2 GB as Python lists), so a ``SimRequest`` keeps its group's shared prefix
array and a seed for its own tail, and builds the list (``prompt_token_ids``) when asked; the
same request always yields the same ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal")
# Token ids are drawn into this dtype (every vocabulary fits; half the bytes of int64).
TOKEN_DTYPE = np.int32
# Independent random streams of one seed, so that changing one part of a workload (say the
# arrival rate) never changes another (the prompts).
_STREAM_LENGTHS = 1
_STREAM_ARRIVALS = 2
_STREAM_PREFIX = 3
_STREAM_SUFFIX = 4
# A gamma shape of 1 gives exponential gaps: a Poisson process (vLLM bench's burstiness).
POISSON_BURSTINESS = 1.0


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution: ``kind`` with parameters ``a``, ``b`` (see the module
    docstring for each kind's meaning)."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind in ("fixed", "uniform") and (self.a != int(self.a) or self.b != int(self.b)):
            raise ValueError(f"{self.kind} lengths must be integers, got {self}")
        if self.kind == "fixed" and self.a < 1:
            raise ValueError(f"a fixed length must be >= 1, got {self.a:g}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform:LO-HI needs 1 <= LO <= HI, got {self.a:g}-{self.b:g}")
        if self.kind in ("normal", "lognormal") and (self.a < 1 or self.b < 0):
            raise ValueError(f"{self.kind} needs a mean >= 1 and a spread >= 0, got {self}")

    @classmethod
    def parse(cls, text: str | int) -> "LengthSpec":
        """``"2000"``, ``"fixed:2000"``, ``"uniform:1000-3000"``, ``"normal:2000,200"``,
        ``"lognormal:2000,0.5"`` (an int is a fixed length)."""
        if isinstance(text, int):
            return cls("fixed", text)
        kind, sep, params = str(text).strip().partition(":")
        if not sep:
            kind, params = "fixed", kind
        separator = {"uniform": "-", "normal": ",", "lognormal": ","}.get(kind)
        if kind not in LENGTH_KINDS:
            raise ValueError(f"length {text!r}: kind must be one of {LENGTH_KINDS}")
        try:
            if separator is None:
                numbers = [int(params)]
            else:
                first, second = params.split(separator)
                cast = int if kind == "uniform" else float
                numbers = [cast(first), cast(second)]
        except ValueError:
            raise ValueError(f"cannot read length {text!r} (see LengthSpec for the forms)") \
                from None
        return cls(kind, *numbers)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}-{int(self.b)}"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def min_length(self) -> int:
        """The shortest length this spec can give."""
        return int(self.a) if self.kind in ("fixed", "uniform") else 1

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths as int64, each >= 1."""
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=n, dtype=np.int64)
        if self.kind == "normal":
            drawn = rng.normal(self.a, self.b, size=n)
        else:
            # The log's mean that gives an arithmetic mean of a: E[exp(X)] = exp(mu + s^2/2).
            mu = math.log(self.a) - self.b ** 2 / 2
            drawn = rng.lognormal(mu, self.b, size=n)
        return np.maximum(np.rint(drawn), 1).astype(np.int64)


def _as_length(value: LengthSpec | str | int) -> LengthSpec:
    return value if isinstance(value, LengthSpec) else LengthSpec.parse(value)


@dataclass(frozen=True)
class WorkloadSpec:
    """What requests a simulation serves.

    Attributes:
        num_requests: requests in the run.
        input_len, output_len: prompt and output token lengths (a ``LengthSpec`` or its
            string). Outputs always run to ``max_tokens`` (the simulator ignores EOS, as
            ``bench --ignore-eos`` does).
        request_rate: open loop: mean arrivals per second over the whole deployment; gaps are
            gamma-distributed with shape ``burstiness`` (1 = Poisson, < 1 burstier, > 1 more
            regular) and the first request arrives at 0. ``inf`` (or neither this nor
            ``concurrency_per_rank``): every request arrives at 0.
        burstiness: the gamma shape above.
        concurrency_per_rank: closed loop: each rank keeps this many requests in flight and
            admits the next one when one finishes (requests carry ``arrival_s=None``).
        num_prefix_groups: 0 = no sharing; else request ``i`` is in group
            ``i % num_prefix_groups`` and starts with that group's ``prefix_len`` ids.
        prefix_len: shared tokens per prompt (every prompt keeps at least one own token: an
            input length below ``prefix_len + 1`` is raised to it).
        seed: the same spec and seed give the same requests, id for id.
    """

    num_requests: int
    input_len: LengthSpec | str | int = "fixed:1024"
    output_len: LengthSpec | str | int = "fixed:128"
    request_rate: float | None = None
    burstiness: float = POISSON_BURSTINESS
    concurrency_per_rank: int | None = None
    num_prefix_groups: int = 0
    prefix_len: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        # Strings are accepted for convenience (CLI, config files) and stored parsed.
        object.__setattr__(self, "input_len", _as_length(self.input_len))
        object.__setattr__(self, "output_len", _as_length(self.output_len))
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if self.request_rate is not None and self.concurrency_per_rank is not None:
            raise ValueError("give a request rate (open loop) or a concurrency per rank "
                             "(closed loop), not both")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.concurrency_per_rank is not None and self.concurrency_per_rank < 1:
            raise ValueError(f"concurrency_per_rank must be >= 1, got {self.concurrency_per_rank}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.num_prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("num_prefix_groups and prefix_len must be >= 0")
        if (self.num_prefix_groups > 0) != (self.prefix_len > 0):
            raise ValueError("prefix sharing needs both num_prefix_groups and prefix_len > 0")
        if self.prefix_len and self.input_len.kind in ("fixed", "uniform") \
                and self.input_len.min_length <= self.prefix_len:
            raise ValueError(f"input_len {self.input_len} must exceed prefix_len "
                             f"{self.prefix_len} (each prompt keeps a token of its own)")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency_per_rank is not None

    def to_dict(self) -> dict:
        return {
            "num_requests": self.num_requests, "input_len": str(self.input_len),
            "output_len": str(self.output_len), "request_rate": self.request_rate,
            "burstiness": self.burstiness, "concurrency_per_rank": self.concurrency_per_rank,
            "num_prefix_groups": self.num_prefix_groups, "prefix_len": self.prefix_len,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload.

    ``prompt_token_ids`` is built on each access (a fresh ``list[int]``; the engine's
    ``Request`` copies it anyway), from ``prefix`` (shared by the request's prefix group, or
    empty) and ``suffix_len`` ids drawn from the request's own ``suffix_seed``.
    """

    request_id: str
    arrival_s: float | None
    max_tokens: int
    num_prompt_tokens: int
    vocab_size: int
    suffix_seed: tuple[int, ...]
    prefix: np.ndarray = field(repr=False, compare=False)
    prefix_group: int | None = None

    @property
    def suffix_len(self) -> int:
        return self.num_prompt_tokens - len(self.prefix)

    def prompt_array(self) -> np.ndarray:
        """The prompt as an int32 array (for callers that hash or count without a list)."""
        rng = np.random.default_rng(self.suffix_seed)
        suffix = rng.integers(0, self.vocab_size, size=self.suffix_len, dtype=TOKEN_DTYPE)
        return np.concatenate([self.prefix, suffix])

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt_array().tolist()


def _arrivals(spec: WorkloadSpec, rng: np.random.Generator) -> list[float | None]:
    n = spec.num_requests
    if spec.closed_loop:
        return [None] * n
    if spec.request_rate is None or math.isinf(spec.request_rate) or n == 0:
        return [0.0] * n
    # Gamma gaps with shape k and scale 1 / (rate k) have mean 1 / rate for every k.
    gaps = rng.gamma(spec.burstiness, 1.0 / (spec.request_rate * spec.burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def generate_requests(spec: WorkloadSpec, vocab_size: int) -> list[SimRequest]:
    """The requests of ``spec`` with ids ``"0"``, ``"1"``, ... in arrival order;
    deterministic per ``spec.seed``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n = spec.num_requests
    length_rng = np.random.default_rng([spec.seed, _STREAM_LENGTHS])
    input_lens = spec.input_len.sample(n, length_rng)
    output_lens = spec.output_len.sample(n, length_rng)
    if spec.prefix_len:
        input_lens = np.maximum(input_lens, spec.prefix_len + 1)
    arrivals = _arrivals(spec, np.random.default_rng([spec.seed, _STREAM_ARRIVALS]))
    prefixes = [
        np.random.default_rng([spec.seed, _STREAM_PREFIX, g]).integers(
            0, vocab_size, size=spec.prefix_len, dtype=TOKEN_DTYPE)
        for g in range(spec.num_prefix_groups)
    ]
    no_prefix = np.empty(0, dtype=TOKEN_DTYPE)
    requests = []
    for i in range(n):
        group = i % spec.num_prefix_groups if spec.num_prefix_groups else None
        requests.append(SimRequest(
            request_id=str(i), arrival_s=arrivals[i], max_tokens=int(output_lens[i]),
            num_prompt_tokens=int(input_lens[i]), vocab_size=vocab_size,
            suffix_seed=(spec.seed, _STREAM_SUFFIX, i),
            prefix=no_prefix if group is None else prefixes[group], prefix_group=group,
        ))
    return requests
