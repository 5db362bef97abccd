"""The sans-I/O codec of the Broky wire protocol (see schema/README.md).

Bytes in, frames out; frames in, bytes out. Nothing here imports asyncio or
socket, so every piece can be fuzzed and benchmarked alone.
"""

from broky.protocol.frames import (
    ANY_WORKER,
    PROTOCOL_VERSION,
    RESUME_TOKEN_BYTES,
    Error,
    Frame,
    Goodbye,
    Hello,
    LossNotice,
    LossReason,
    MapApplied,
    MapUpdate,
    Pause,
    Ping,
    Pong,
    PreviousConnection,
    Resume,
    Resumed,
    Subscribe,
    Unsubscribe,
    Welcome,
    WelcomeTemplate,
    decode_frame,
    encode_frame,
)
from broky.protocol.framing import DEFAULT_MAX_FRAME_BYTES, NEED_DATA, FrameReader
from broky.protocol.ksuid import ksuid_text, new_ksuid, parse_ksuid
from broky.protocol.message import Message, decode_message, encode_message, route_message
from broky.protocol.routing import NO_OWNER, VBUCKETS, NodeInfo, VBucketMap, vbucket_of

__all__ = [
    "ANY_WORKER",
    "DEFAULT_MAX_FRAME_BYTES",
    "NEED_DATA",
    "NO_OWNER",
    "PROTOCOL_VERSION",
    "RESUME_TOKEN_BYTES",
    "VBUCKETS",
    "Error",
    "Frame",
    "FrameReader",
    "Goodbye",
    "Hello",
    "LossNotice",
    "LossReason",
    "MapApplied",
    "MapUpdate",
    "Message",
    "NodeInfo",
    "Pause",
    "Ping",
    "Pong",
    "PreviousConnection",
    "Resume",
    "Resumed",
    "Subscribe",
    "Unsubscribe",
    "VBucketMap",
    "Welcome",
    "WelcomeTemplate",
    "decode_frame",
    "decode_message",
    "encode_frame",
    "encode_message",
    "ksuid_text",
    "new_ksuid",
    "parse_ksuid",
    "route_message",
    "vbucket_of",
]
