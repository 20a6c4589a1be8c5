"""The daemon's HTTP routes, each a FastAPI ``APIRouter`` over the running ``Node``: the ops API
(``ops``: health, readiness, what is cached and held, the gate, metrics) and the peer API other
daemons call (``peer``: shard reads and replica pushes). Errors are the shared classes of
``ffplane_contract.errors``, answered by one handler (``_errors``)."""

from statestore.routes._errors import answer_errors
from statestore.routes._node import NODE
from statestore.routes.ops import router as ops_router
from statestore.routes.peer import router as peer_router

__all__ = ["NODE", "answer_errors", "ops_router", "peer_router"]
