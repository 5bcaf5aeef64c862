"""Print the Debian mirror the host's apt sources use (first deb822 or one-line entry).

Used by setup-host.sh so an added suite goes through the same mirror (and proxy)
as the host's existing entries.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from boxd.images._apt import debian_mirror  # noqa: E402

print(debian_mirror())
