# Types of policies._gc (policies/_gc.c).
from typing import TypeVar

T = TypeVar("T")

def untrack(obj: T) -> T: ...
