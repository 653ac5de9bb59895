"""The rehearsal's tables: one per stage, a column per distinct rank, a row per term,
each cell "built / planned" in GiB ("-" where a term is only planned)."""

from __future__ import annotations

from rich.table import Table

from moerl.rehearsal.verdict import GiB, Rehearsed


def _cell(rank: Rehearsed, term: str) -> str:
    planned = rank.planned.get(term)
    built = rank.built.get(term)
    left = "-" if built is None else f"{built / GiB:.2f}"
    right = "-" if planned is None else f"{planned / GiB:.2f}"
    return f"{left} / {right}"


def stage_table(ranks: list[Rehearsed], title: str) -> Table:
    """Every term of `ranks` (all of one stage), built / planned GiB per rank."""
    table = Table(title=title)
    table.add_column("term (GiB: built / planned)")
    for rank in ranks:
        same = (f" = pp {rank.same_as[0]}-{rank.same_as[-1]}" if len(rank.same_as) > 1
                else "")
        table.add_column(f"rank {rank.rank}\npp {rank.pp_rank}{same}", justify="right")
    terms = list(dict.fromkeys(t for r in ranks for t in (*r.planned, *r.built)))
    for term in terms:
        table.add_row(term, *[_cell(r, term) for r in ranks])
    table.add_row("total (budget)", *[f"{r.total / GiB:.1f} ({r.budget / GiB:.1f})"
                                      for r in ranks])
    table.add_row("verdict", *["fits" if not r.problems else "REFUSED" for r in ranks])
    return table
