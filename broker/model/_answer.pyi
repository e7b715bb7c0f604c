# Types of broker.model._answer, the native writer of DirectiveBatch bytes (broker/model/_answer.c).
from typing import Any

def encode_answer(
    client_id: str, batch_seq: int, directives: list[Any], accepted_events: int, duplicate: bool, config_generation: int
) -> bytes: ...
