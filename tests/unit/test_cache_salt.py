"""check_cache_salt: the one validation of the cache_salt field (INVALID_ARGUMENT)."""

from __future__ import annotations

import grpc
import pytest

from deltakv.cache_salt import MAX_CACHE_SALT_CHARS, check_cache_salt
from deltakv.errors import InvalidArgument


def test_salts_within_the_limit_pass_and_others_are_invalid_argument() -> None:
    assert check_cache_salt("") == ""
    assert check_cache_salt("tenant-7") == "tenant-7"
    assert check_cache_salt("x" * MAX_CACHE_SALT_CHARS) == "x" * MAX_CACHE_SALT_CHARS
    with pytest.raises(InvalidArgument, match="limit is 256") as info:
        check_cache_salt("x" * (MAX_CACHE_SALT_CHARS + 1))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details["field"] == "cache_salt"
    with pytest.raises(InvalidArgument, match="string"):
        check_cache_salt(7)
