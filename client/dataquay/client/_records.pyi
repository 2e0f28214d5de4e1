"""C loops over the key and value layouts of dataquay.client.records (_records.c)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def sample_keys(ids: Sequence[int], /) -> list[bytes]: ...
def payload_copies(
    values: Sequence[Buffer | None], verify: bool, /
) -> tuple[list[bytes | None], int, int]: ...
def encode_value(payload: Buffer, digest: int | None = None, /) -> bytes: ...
