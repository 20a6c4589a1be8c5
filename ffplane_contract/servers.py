"""Several data servers, as their clients see them: the list a daemon or a worker is given
(``--dataserver`` / ``$FFPLANE_DATASERVER``: comma-separated URLs) and the header with which a
server that does not coordinate names the one that does."""

from __future__ import annotations

from urllib.parse import urlsplit

# On a 421 from a data server that does not coordinate: the URL of the one that does (empty while none does).
LEADER_HEADER = "X-FFplane-Leader"
DATASERVER_ENV = "FFPLANE_DATASERVER"  # the data server URL(s) for workers and the ffplane command


def parse_urls(spec: str) -> list[str]:
    """``"http://a:8470,http://b:8470"`` as a list; ValueError naming an entry that is no URL."""
    urls = []
    for item in (i.strip().rstrip("/") for i in spec.split(",")):
        if not item:
            continue
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"data server {item!r} is not a URL like http://10.0.0.1:8470")
        urls.append(item)
    if not urls:
        raise ValueError("no data server given: pass --dataserver http://HOST:PORT[,http://HOST:PORT...]")
    return urls
