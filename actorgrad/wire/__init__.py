"""Sans-IO wire protocol: bytes in, messages out. No asyncio, no sockets, no clocks."""

from __future__ import annotations

from ._codec import Payload as Payload
from ._codec import dumps as dumps
from ._connection import Connection as Connection
from ._connection import Established as Established
from ._connection import State as State
from ._connection import decode_frame as decode_frame
from ._connection import tcp_endpoint as tcp_endpoint
from ._connection import unix_endpoint as unix_endpoint
from ._frames import DEFAULT_MAX_BUFFERS as DEFAULT_MAX_BUFFERS
from ._frames import DEFAULT_MAX_FRAME_SIZE as DEFAULT_MAX_FRAME_SIZE
from ._frames import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._frames import FrameDecoder as FrameDecoder
from ._frames import encode_frame as encode_frame
from ._messages import Auth as Auth
from ._messages import Call as Call
from ._messages import Cancel as Cancel
from ._messages import Failure as Failure
from ._messages import Goodbye as Goodbye
from ._messages import Heartbeat as Heartbeat
from ._messages import Hello as Hello
from ._messages import Kind as Kind
from ._messages import Message as Message
from ._messages import Result as Result
from ._messages import Tell as Tell
from ._typed import TupleMessage as TupleMessage
