"""Decoding beyond free text: constraints, tool calls, control signals, the repeated-line guard.

Backend-neutral and free of native imports (no grpc, protobuf, HTTP, llama_cpp or
openvino_genai at module level), so the engine, the reference backend and workers can all use
it. The modules:

* :mod:`~modeld.decoding.constraints` compiles a :class:`~modeld.contract.Constraint` (JSON
  schema, regex, GBNF grammar, plain JSON) once, cached by digest, into GBNF;
* :mod:`~modeld.decoding.gbnf` parses GBNF with error positions and
  :mod:`~modeld.decoding.gbnf_match` matches it byte by byte (the reference backend's
  enforcement);
* :mod:`~modeld.decoding.schema` and :mod:`~modeld.decoding.regex` turn JSON schemas and
  regular expressions into GBNF;
* :mod:`~modeld.decoding.toolcalls` parses tool calls out of a model's output, incrementally;
* :mod:`~modeld.decoding.tools` reads tool definitions, builds the constraint that forces a
  call (``tool_choice``), and tells exit tools (signals) apart;
* :mod:`~modeld.decoding.guard` stops a model that repeats one line;
* :mod:`~modeld.decoding.samplers` is the one sampler table (name, default, OpenAI name, range)
  and :mod:`~modeld.decoding.sampling` the reference semantics of the extra samplers.

The design record is ``blueprints/0018-constraints-and-tool-calls.md``.
"""
