"""The JetStream subjects a user may touch (``access.py`` grants them): the scheduler's
administration, the model weights' object store (read, write, delete), and a device's own
pull consumer on its work."""

from __future__ import annotations

from libs.contracts import SHARD_TASK
from libs.contracts.channels import MODEL_BUCKET, STREAMS, work_consumer

#: The scheduler's JetStream: streams, its key-value buckets, publishing into streams.
JETSTREAM_ADMIN = ("$JS.API.>", "$KV.>")
WORK_STREAM = next(name for name, subjects in STREAMS.items() if SHARD_TASK.wildcard in subjects)
MODEL_STREAM = f"OBJ_{MODEL_BUCKET}"
#: Reading the model weights' object store, nothing more: the stream's info (nats-py's
#: ``object_store``, which names the stream: listing streams is refused), a message by
#: subject (an object's meta, directly or through the API) and JetStream's direct get by
#: sequence (``libs/weights/whole_files.py``'s fetch: batches of an object's chunks onto the
#: reader's own inbox). No consumer: its creator chooses where a push consumer delivers, so a
#: grant to make one would let a device pour the weights onto any subject. No put, delete or
#: purge: ``$O.TESSERA_MODELS.>`` itself is not granted.
MODEL_READ = (
    f"$JS.API.STREAM.INFO.{MODEL_STREAM}",
    f"$JS.API.STREAM.MSG.GET.{MODEL_STREAM}",
    f"$JS.API.DIRECT.GET.{MODEL_STREAM}",
    f"$JS.API.DIRECT.GET.{MODEL_STREAM}.>",
)
#: Marking an object of the model store deleted (its meta, with a rollup; the scheduler purges
#: the chunks through ``$JS.API``, which it holds already): no chunk is ever written.
MODEL_DELETE = (f"$O.{MODEL_BUCKET}.M.>",)
#: Putting weights into the model store (``whole_files.publish``): the bucket made when missing,
#: chunks and meta written, a failed put's chunks purged; no other stream.
MODEL_WRITE = (
    *MODEL_READ,
    f"$JS.API.STREAM.CREATE.{MODEL_STREAM}",
    f"$JS.API.STREAM.PURGE.{MODEL_STREAM}",
    f"$O.{MODEL_BUCKET}.>",
)


def work_grant(device_id: str) -> tuple[str, ...]:
    """A device's own pull consumer on its own shard tasks: create it (by name and filter
    subject), read its info, pull its next message, acknowledge its messages."""
    consumer = work_consumer(device_id)
    api = "$JS.API.CONSUMER"
    own = f"{WORK_STREAM}.{consumer}"
    return (
        f"{api}.CREATE.{own}.{SHARD_TASK.subject(device_id=device_id)}",
        f"{api}.INFO.{own}",
        f"{api}.MSG.NEXT.{own}",
        f"$JS.ACK.{own}.>",
    )
