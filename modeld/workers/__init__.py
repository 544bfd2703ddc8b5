"""Engine workers: the protocol, the engine-side scheduler, the hosts and their supervision.

* :mod:`modeld.workers.protocol`: coarse, serializable messages (one unit of work each);
* :mod:`modeld.workers.scheduler`: the engine side (one thread, jobs interleaved step by step);
* :mod:`modeld.workers.host`: the daemon side (typed calls, cancel by message) and the
  in-process host;
* :mod:`modeld.workers.proxy` / :mod:`modeld.workers.child`: the worker process and its entry
  point;
* :mod:`modeld.workers.supervisor`: death noticed at once, restarts with backoff, stall watchdog.

Design record: ``blueprints/0017-workers.md``. No grpc, protobuf or HTTP here, and nothing in the daemon
process imports llama_cpp or openvino_genai: only the worker does.
"""
