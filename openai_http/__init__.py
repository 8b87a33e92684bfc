"""OpenAI-compatible HTTP serving, shared by the router's HTTP edge and the sim worker's HTTP face.

- :mod:`openai_http.protocol`: the request bodies (validated, every field
  bounded, errors naming the field) and the response and stream-chunk shapes
  of ``/v1/completions`` and ``/v1/chat/completions``, and OpenAI's error shape.
- :mod:`openai_http.app`: a Starlette app over a :class:`~openai_http.app.Backend`
  (the thing that turns a parsed request into text pieces), with SSE streaming,
  ``/v1/models``, ``/health`` and ``/metrics``, served by uvicorn on the
  caller's event loop (:class:`~openai_http.app.HttpServer`).

May import the generated protobuf modules only (``slorouter.v1``); the router
and the workers import it, never the reverse.
"""
