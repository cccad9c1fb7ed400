"""The config manager's spool of catalog uploads streamed in parts (``deployments/manager/uploads.py``): parts in
order, a part sent again taken once, every bound checked before a byte is written (size 413, uploads under way 429,
order 409, the id's form 422), a finished upload's size checked, idle and dropped uploads removed, a restart's leftovers
removed. Real files in a temporary directory."""

from __future__ import annotations

import os

import pytest

from deployments.manager.uploads import MAX_OPEN_UPLOADS, UploadSpool
from deployments.protocol import ServiceError


def _id(k: int) -> str:
    return f"{k:032x}"


def _status(call, *args) -> int:
    with pytest.raises(ServiceError) as info:
        call(*args)
    return info.value.status


def test_parts_in_order_make_the_file_and_a_retried_part_is_taken_once(tmp_path):
    spool = UploadSpool(str(tmp_path / "uploads"), lambda: 1 << 20)
    assert spool.append(_id(1), 0, b"abc") == 3
    assert spool.append(_id(1), 3, b"defg") == 7
    assert spool.append(_id(1), 3, b"defg") == 7  # sent again (a retry): there already
    assert _status(spool.append, _id(1), 2, b"zz") == 409  # any other offset
    assert _status(spool.append, _id(1), 9, b"zz") == 409
    assert _status(spool.finished, _id(1), 8) == 409  # the size sent is not what arrived: refused and removed
    assert not os.listdir(tmp_path / "uploads")
    assert spool.append(_id(2), 0, b"abc") == 3
    path = spool.finished(_id(2), 3)
    assert open(path, "rb").read() == b"abc"
    assert _status(spool.append, _id(2), 3, b"d") == 404  # finished: no more parts
    spool.drop(_id(2))
    assert not os.listdir(tmp_path / "uploads") and spool.under_way() == 0


def test_bounds_come_before_any_byte_is_written(tmp_path):
    spool = UploadSpool(str(tmp_path), lambda: 10)
    assert _status(spool.append, _id(1), 0, b"x" * 11) == 413 and not os.listdir(tmp_path)
    spool.append(_id(1), 0, b"x" * 6)
    assert _status(spool.append, _id(1), 6, b"x" * 5) == 413
    assert os.path.getsize(tmp_path / f"{_id(1)}.part") == 6
    for bad in ("../../etc/passwd", "A" * 32, "", _id(1) + "0"):
        assert _status(spool.append, bad, 0, b"x") == 422
    assert _status(spool.append, _id(99), 5, b"x") == 404  # not under way: only a first part opens one
    for k in range(2, MAX_OPEN_UPLOADS + 1):
        spool.append(_id(k), 0, b"x")
    assert _status(spool.append, _id(50), 0, b"x") == 429 and spool.under_way() == MAX_OPEN_UPLOADS
    spool.drop(_id(2))
    assert spool.append(_id(50), 0, b"x") == 1  # one ended: room again


def test_idle_uploads_are_swept_and_a_restart_removes_leftovers(tmp_path):
    spool = UploadSpool(str(tmp_path), lambda: 1 << 20, idle_s=0.0)
    spool.append(_id(1), 0, b"abc")
    spool.append(_id(2), 0, b"abc")  # (its sweep removes the first: idle past 0 s)
    assert not (tmp_path / f"{_id(1)}.part").exists() and (tmp_path / f"{_id(2)}.part").exists()
    assert _status(spool.append, _id(1), 3, b"d") == 404
    (tmp_path / "unrelated.txt").write_text("kept")
    UploadSpool(str(tmp_path), lambda: 1 << 20)  # a manager starting again
    assert os.listdir(tmp_path) == ["unrelated.txt"]


def test_a_part_that_arrives_after_its_upload_was_dropped_makes_no_file(tmp_path):
    """A client gone mid-upload: the ingress drops the upload while a part may still be on its way (a cancelled call
    goes on in the manager). That part, the upload's first or a later one, is a 404 and leaves no file: nothing
    would ever remove one (it is under way for no one)."""
    spool = UploadSpool(str(tmp_path), lambda: 1 << 20)
    spool.append(_id(1), 0, b"abc")
    spool.drop(_id(1))
    assert _status(spool.append, _id(1), 3, b"def") == 404
    assert _status(spool.append, _id(1), 0, b"abc") == 404  # (the first part overtaken by the drop)
    assert os.listdir(tmp_path) == [] and spool.under_way() == 0
    spool.drop(_id(2))  # dropped before its first part arrived
    assert _status(spool.append, _id(2), 0, b"abc") == 404 and os.listdir(tmp_path) == []
