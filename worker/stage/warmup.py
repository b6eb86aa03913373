"""The stage's warm-up at load: each piece a first answer needs, run once on throwaway
state, so the first answer of a placement starts as fast as the second."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from worker.sampling import Sampler, SamplingParams, TextStream
from worker.speculation import DraftSession
from worker.stage.base import StageBase

# The throwaway prompt's length: a short prefill, then decode steps after it.
WARM_PROMPT = 4


class WarmUp(StageBase):
    """The pieces MLX builds on first use (its kernels, `mx.compile`'d functions such
    as the fused CPU ops and the samplers) and the tokenizer's (its chat template,
    compiled by Jinja on the first request; its detokenizer), run before the runner
    says "ready"."""

    def warm_up(self) -> dict[str, float]:
        """Run this stage's pieces once on a cache of its own and report how long each
        took (ms). No request, cache entry or figure of the stage is touched. Every rank
        of a tensor group runs the same steps (its layers' all-reduces pair up)."""
        took: dict[str, float] = {}

        def timed(name: str, run: Callable[[], object]) -> None:
            began = time.perf_counter()
            run()
            took[name] = (time.perf_counter() - began) * 1000

        cache = self.shard.make_cache()

        def step(n: int) -> mx.array:
            if self.shard.is_first:
                h = self.shard.embed(mx.zeros((1, n), dtype=mx.int32))
            else:
                h = mx.zeros((1, n, self.hidden), dtype=self.shard.dtype)
            out = self.shard.forward(h, cache)
            mx.eval(out)
            return out

        timed("prefill", lambda: step(WARM_PROMPT))
        timed("decode", lambda: step(1))
        if self.draft:
            timed("verify", lambda: step(1 + self.draft_tokens))
        if self.shard.is_last:
            timed("sample", lambda: self._warm_samplers(step(1)))
        if self.draft_model is not None:
            session = DraftSession(self.draft_model, self.prefill_chunk)
            timed("draft", lambda: session.propose(list(range(WARM_PROMPT)), self.draft_tokens))
        if self.shard.is_first and self.tokenizer is not None:
            timed("tokenizer", self._warm_tokenizer)
        took["total"] = sum(took.values())
        self.warmed = took
        return took

    def _warm_samplers(self, out: mx.array) -> None:
        """The greedy draw and a sampled one with log-probabilities (a seed of its own:
        the requests' keys are their own too)."""
        logits = self.shard.logits(out)
        mx.eval(mx.argmax(logits, axis=-1))
        params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2)
        mx.eval(Sampler(params, self.xtc_special).draw(logits))

    def _warm_tokenizer(self) -> None:
        """The chat template (a model without one is asked for plain prompts: nothing
        to compile) and the detokenizer."""
        try:
            tokens = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hello"}], add_generation_prompt=True
            )
        except Exception:
            tokens = self.tokenizer.encode("Hello")
        stream = TextStream(self.tokenizer.detokenizer, ())
        for token in list(tokens)[:WARM_PROMPT]:
            stream.add(int(token))
        stream.finish()
