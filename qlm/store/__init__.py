"""The state store: a write-behind record of requests, instances and plans (SQLAlchemy async).

``Store`` is what the coordinator uses; ``migrate(url)`` brings a database to the newest schema
(``Store.open`` calls it); the ORM models define the schema that the Alembic tree in
``migrations/`` creates.
"""

from qlm.store.answers import AnswerLog, AnswerLogUnavailable, StoredAnswer
from qlm.store.migrations import migrate, migrations_dir
from qlm.store.models import (
    INSTANCE_STATUSES,
    Answer,
    Base,
    EngineProfile,
    HardwareProfileRun,
    Instance,
    Plan,
    Request,
    RequestEvent,
    RequestStatus,
)
from qlm.store.store import Store
from qlm.store.writer import BatchWriter, StoreStats

__all__ = [
    "INSTANCE_STATUSES",
    "Answer",
    "AnswerLog",
    "AnswerLogUnavailable",
    "BatchWriter",
    "Base",
    "EngineProfile",
    "HardwareProfileRun",
    "Instance",
    "Plan",
    "Request",
    "RequestEvent",
    "RequestStatus",
    "Store",
    "StoreStats",
    "StoredAnswer",
    "migrate",
    "migrations_dir",
]
