"""Ray Serve side of the service: ingress, model replicas, config manager, app builder.

Importing this package must stay cheap: it does not import Ray (or torch). Import the
submodules you need, e.g. ``from deployments.model_loader import load_model_and_tokenizer``.
"""

__all__ = []
