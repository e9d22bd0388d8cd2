"""Records in relpath order, a page at a time: the order every tier walks in (code points), on
both backends, so scan can merge the catalog with the walks. (A PostgreSQL database created
with a language's collation, such as en_US.UTF-8, would put ``a/b`` before ``a.b`` and ``A``
among the ``a``'s: :meth:`~tiering.catalog.Catalog.by_relpath` asks for ``"C"``.)"""

from __future__ import annotations

from tests.helpers import put
from tiering.engine import Engine


def test_records_come_in_code_point_order_a_page_at_a_time(eng: Engine) -> None:
    names = ["a0", "a/b", "a.b", "A", "a/\u00e9", "\u4e2d/x", "b", "a-z", "a/B", "Z"]
    for name in names:
        put(eng, name, name.encode())
    for batch in (1, 3, len(names), 100):
        assert [r.relpath for r in eng.catalog.by_relpath(batch)] == sorted(names), batch
