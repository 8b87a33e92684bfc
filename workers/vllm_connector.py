"""vLLM's ``ExampleConnector`` with a guard against a load it cannot complete.

``ExampleConnector`` moves KV through a shared directory: every request's
whole-block prompt prefix is written to ``<dir>/<hash of the prefix>/``, and a
later request whose prompt extends that prefix loads it instead of computing
it. In vLLM 0.32 the existence check hashes the prefix of
``align(len(prompt) - 1)`` tokens, but the load reads the files of
``align(len(prompt))`` tokens (``align(n) = (n - 1) // block * block``). The
two differ exactly when ``len(prompt) - 1`` is a multiple of the block size
(a decode of a 256-token prompt plus its first token, with 128-token blocks):
the engine then opens files that were never written and dies.

:class:`GuardedExampleConnector` reports "nothing to load" in that case, so the
decode instance recomputes the prompt instead (the right tokens, just no
transfer). The ``vllm`` engine substitutes it whenever ``ExampleConnector`` is
asked for. This module imports vLLM and runs inside vLLM's engine process.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

#: The name under which the vLLM engine configures this class.
CONNECTOR_NAME = "GuardedExampleConnector"
#: The connector this one replaces.
REPLACES = "ExampleConnector"


def _aligned(num_tokens: int, block_size: int) -> int:
    """ExampleConnector's prefix length for ``num_tokens`` tokens (whole blocks, last token excluded)."""
    return (num_tokens - 1) // block_size * block_size


class GuardedExampleConnector(ExampleConnector):  # type: ignore[misc]
    """``ExampleConnector`` that never promises a load whose files it would look for under another name."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        num_prompt = len(request.prompt_token_ids or ())
        if _aligned(num_prompt, self._block_size) != _aligned(num_prompt - 1, self._block_size):
            return 0, False
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        # The parent subtracts local prefix-cache hits without a floor.
        return max(0, matched or 0), is_async
