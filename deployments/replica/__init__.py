"""The model replica (``model_replica.py``: the model and the decode engine, and the two parts it holds for its two
jobs: the scenario subscription, ``subscriber.py``, and the request handling behind ``generate`` /
``generate_stream``, ``requests.py``), with what it does to a request around the engine:

* ``item_controls.py``: a request's item controls (``exclude``, ``distinct``, ``max_items``, the token budget)
  checked against its scenario before it is admitted;
* ``regenerate.py``: every finished JSON output validated, and generated again when it fails;
* ``answer.py``: the answer's forms (label text with or without its leading space, the think block split off) and
  the incremental decoding of streamed text;
* ``stops.py``: stop strings matched as tokens arrive.
"""

from .model_replica import ModelReplica, ServeModelReplica

__all__ = ["ModelReplica", "ServeModelReplica"]
