"""The scenario store's failure kinds and the one place their HTTP statuses are chosen.

``deployments/storage/store*.py`` raise failures by kind (``deployments/storage/errors.py``) and name no HTTP status; the
statuses come from ``deployments/scenario_errors.py:STORE_ERROR_STATUS``. The statuses clients see are the ones
the store answered before the split (404 unknown, 409 delete entry / base changed, 410 pruned, 422 refused input,
500 corrupt, 503 unavailable).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from deployments.protocol import ServiceError
from deployments.scenario_errors import STORE_ERROR_STATUS
from deployments.storage.store import validate_idempotency_key, validate_name
from deployments.storage.errors import (
    BaseChanged,
    Gone,
    InvalidRequest,
    NotFound,
    StoreCorrupt,
    StoreUnavailable,
    VersionConflict,
    key_reused,
    pruned_error,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind, status", [(InvalidRequest, 422), (NotFound, 404), (VersionConflict, 409),
                                          (Gone, 410), (StoreUnavailable, 503), (StoreCorrupt, 500)])
def test_each_kind_gets_its_status_from_the_one_mapping(kind, status):
    error = kind("what happened", {"name": "x"})
    assert isinstance(error, ServiceError)
    assert error.status == status == STORE_ERROR_STATUS[kind.__name__]
    assert error.message == "what happened" and error.detail == {"name": "x"}
    copy = pickle.loads(pickle.dumps(error))  # across Ray: a plain ServiceError with every field
    assert type(copy) is ServiceError and (copy.status, copy.message, copy.detail) == (status, "what happened",
                                                                                       {"name": "x"})


def test_the_helpers_answer_as_before():
    changed = BaseChanged("s", 3, 4)
    assert isinstance(changed, VersionConflict) and changed.status == 409 and changed.current == 4
    assert changed.detail == {"name": "s", "field": "base_version", "base_version": 3, "current_version": 4}
    gone = pruned_error("s", 2)
    assert gone.status == 410 and "history_bodies" in gone.message and gone.detail["pruned"] is True
    assert key_reused("k").status == 422
    for check, value in ((validate_name, "bad name"), (validate_idempotency_key, "two words")):
        with pytest.raises(ServiceError) as info:
            check(value)
        assert info.value.status == 422 and isinstance(info.value, InvalidRequest)


def test_the_storage_layer_names_no_http_status():
    for path in sorted((ROOT / "deployments").glob("store*.py")):
        text = path.read_text()
        assert not re.search(r"ServiceError\(\s*\d", text), f"{path.name} chooses an HTTP status"
