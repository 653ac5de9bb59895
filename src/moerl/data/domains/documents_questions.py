"""Questions about a company report whose answers combine figures from different pages.

Kinds (each has one or two variants, picked per record):
    sum         revenue of one segment in a first-half and a second-half quarter;
                employees plus contractors of one region
    difference  operating profit of a segment in a quarter (revenue table minus costs table)
    growth      change in percent, rounded to one decimal: a segment's revenue from a
                first-half to a second-half quarter; a region's employees from the
                previous year (a sentence) to this year (a table)
    largest     the segment with the highest revenue over both half-year tables; the region
                with the largest workforce over the employees and contractors tables
    ratio       capital expenditure per employee of a region; employees per contractor of
                a region; both rounded to two decimals

Answers are plain numbers without separators ("2690", "-4.5%", "7.74") or a name.
Rounding is half away from zero, computed on exact fractions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from moerl.data.domains.documents_company import (
    QUARTERS,
    REGIONS,
    SEGMENTS,
    Company,
    Figure,
    Layout,
    figure,
    thousands,
)

KINDS = ("sum", "difference", "growth", "largest", "ratio")


@dataclass(frozen=True)
class Question:
    kind: str
    text: str
    answer: str
    aliases: tuple[str, ...]
    figures: tuple[Figure, ...]
    """every figure the answer needs, each with its page"""
    explanation: str
    """one short sentence that derives the answer, for the reference completion"""

    @property
    def pages(self) -> list[int]:
        """The distinct pages the answer needs, ascending."""
        return sorted({f.page for f in self.figures})


_Parts = tuple[dict[str, Any], str, tuple[str, ...], tuple[Figure, ...], str]
"""(template fields, answer, aliases, figures, explanation) of a variant."""


@dataclass(frozen=True)
class _Variant:
    template: str
    build: Callable[[Company, Layout, random.Random], _Parts | None]
    """None when this company's figures make the question unfit (e.g. a tie)."""


def rounded(value: Fraction, places: int) -> str:
    """`value` to `places` decimals, half away from zero: Fraction(-1, 8), 2 -> "-0.13"."""
    units = math.floor(abs(value) * 10**places + Fraction(1, 2))
    whole, part = divmod(units, 10**places)
    sign = "-" if value < 0 and units else ""
    return f"{sign}{whole}.{part:0{places}d}"


def _half_quarters(rng: random.Random) -> tuple[str, str]:
    return rng.choice(QUARTERS[:2]), rng.choice(QUARTERS[2:])


def _revenue_figure(company: Company, layout: Layout, segment: str, quarter: str) -> Figure:
    half = "revenue_h1" if quarter in QUARTERS[:2] else "revenue_h2"
    return figure(company, layout, half, segment, quarter)


def _value(fig: Figure) -> int:
    return int(fig.value.replace(",", ""))


def _sum_revenue(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    segment = rng.choice(company.segments)
    first, second = _half_quarters(rng)
    a, b = (_revenue_figure(company, layout, segment, q) for q in (first, second))
    total = _value(a) + _value(b)
    return ({"segment": segment, "qa": first, "qb": second, "year": company.year},
            str(total), (), (a, b),
            f"{segment} revenue was {a.value} in {first} (page {a.page}) and {b.value} in "
            f"{second} (page {b.page}), {thousands(total)} together.")


def _sum_workforce(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    region = rng.choice(company.regions)
    staff = figure(company, layout, "employees", region, "Employees")
    hired = figure(company, layout, "contractors", region, "Contractors")
    total = _value(staff) + _value(hired)
    return ({"region": region, "year": company.year}, str(total), (), (staff, hired),
            f"{region} had {staff.value} employees (page {staff.page}) and {hired.value} "
            f"contractors (page {hired.page}), {thousands(total)} people.")


def _difference(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    segment = rng.choice(company.segments)
    apart = [q for q in QUARTERS
             if _revenue_figure(company, layout, segment, q).page != layout["costs"]]
    quarter = rng.choice(apart)
    revenue = _revenue_figure(company, layout, segment, quarter)
    costs = figure(company, layout, "costs", segment, quarter)
    profit = _value(revenue) - _value(costs)
    return ({"segment": segment, "qa": quarter, "year": company.year}, str(profit), (),
            (revenue, costs),
            f"{segment} revenue in {quarter} was {revenue.value} (page {revenue.page}) and "
            f"its operating costs {costs.value} (page {costs.page}), a profit of "
            f"{thousands(profit)}.")


def _growth(old: Figure, new: Figure) -> str:
    return rounded(Fraction(_value(new) - _value(old), _value(old)) * 100, 1)


def _growth_revenue(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    segment = rng.choice(company.segments)
    first, second = _half_quarters(rng)
    old, new = (_revenue_figure(company, layout, segment, q) for q in (first, second))
    change = _growth(old, new)
    return ({"segment": segment, "qa": first, "qb": second, "year": company.year},
            f"{change}%", (), (old, new),
            f"{segment} revenue went from {old.value} in {first} (page {old.page}) to "
            f"{new.value} in {second} (page {new.page}), a change of {change}%.")


def _growth_employees(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    region = rng.choice(company.regions)
    old = figure(company, layout, "prior_employees", region, "previous year employees")
    new = figure(company, layout, "employees", region, "Employees")
    change = _growth(old, new)
    return ({"region": region, "year": company.year, "prev": company.year - 1},
            f"{change}%", (), (old, new),
            f"Employees in {region} went from {old.value} (page {old.page}) to {new.value} "
            f"(page {new.page}), a change of {change}%.")


def _leader(totals: dict[str, int]) -> str | None:
    """The key of the strictly highest total, None on a tie."""
    ranked = sorted(totals.values(), reverse=True)
    return None if ranked[0] == ranked[1] else max(totals, key=lambda k: totals[k])


def _combined_leader(parts: list[dict[str, int]]) -> tuple[str, int] | None:
    """The leader of the summed parts when it is unique and not the leader of every part
    alone (so no single table gives the answer away), with its total."""
    totals = {k: sum(p[k] for p in parts) for k in parts[0]}
    winner = _leader(totals)
    if winner is None or all(_leader(p) == winner for p in parts):
        return None
    return winner, totals[winner]


def _largest_revenue(company: Company, layout: Layout, rng: random.Random) -> _Parts | None:
    halves = [{s: sum(v[:2]) for s, v in company.revenue.items()},
              {s: sum(v[2:]) for s, v in company.revenue.items()}]
    found = _combined_leader(halves)
    if found is None:
        return None
    winner, total = found
    figures = tuple(_revenue_figure(company, layout, s, q)
                    for s in company.segments for q in QUARTERS)
    return ({"year": company.year}, winner, (f"{winner} segment", f"the {winner} segment"),
            figures,
            f"Adding the half-year tables (pages {layout['revenue_h1']} and "
            f"{layout['revenue_h2']}), {winner} leads with {thousands(total)}.")


def _largest_workforce(company: Company, layout: Layout, rng: random.Random) -> _Parts | None:
    found = _combined_leader([company.employees, company.contractors])
    if found is None:
        return None
    winner, total = found
    figures = tuple(figure(company, layout, block, r, column) for r in company.regions
                    for block, column in (("employees", "Employees"),
                                          ("contractors", "Contractors")))
    return ({"year": company.year}, winner, (f"{winner} region", f"the {winner} region"),
            figures,
            f"Adding employees (page {layout['employees']}) and contractors (page "
            f"{layout['contractors']}), {winner} leads with {thousands(total)} people.")


def _ratio_capex(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    region = rng.choice(company.regions)
    spent = figure(company, layout, "capex", region, "Capex")
    staff = figure(company, layout, "employees", region, "Employees")
    ratio = rounded(Fraction(_value(spent), _value(staff)), 2)
    return ({"region": region, "year": company.year}, ratio, (), (spent, staff),
            f"{region} spent {spent.value} (page {spent.page}) for {staff.value} employees "
            f"(page {staff.page}), {ratio} per employee.")


def _ratio_staff(company: Company, layout: Layout, rng: random.Random) -> _Parts:
    region = rng.choice(company.regions)
    staff = figure(company, layout, "employees", region, "Employees")
    hired = figure(company, layout, "contractors", region, "Contractors")
    ratio = rounded(Fraction(_value(staff), _value(hired)), 2)
    return ({"region": region, "year": company.year}, ratio, (), (staff, hired),
            f"{region} had {staff.value} employees (page {staff.page}) and {hired.value} "
            f"contractors (page {hired.page}), a ratio of {ratio}.")


_VARIANTS: dict[str, tuple[_Variant, ...]] = {
    "sum": (
        _Variant("What was the combined revenue of the {segment} segment in {qa} and {qb} "
                 "{year}, in USD thousand?", _sum_revenue),
        _Variant("How many people worked for the company in {region} at the end of {year}, "
                 "employees and contractors together?", _sum_workforce),
    ),
    "difference": (
        _Variant("What was the operating profit (revenue minus operating costs) of the "
                 "{segment} segment in {qa} {year}, in USD thousand?", _difference),
    ),
    "growth": (
        _Variant("By how many percent did the revenue of the {segment} segment change from "
                 "{qa} to {qb} {year}? Round to one decimal place.", _growth_revenue),
        _Variant("By how many percent did the number of employees in {region} change from "
                 "the end of {prev} to the end of {year}? Round to one decimal place.",
                 _growth_employees),
    ),
    "largest": (
        _Variant("Which segment had the highest revenue over all four quarters of {year} "
                 "together?", _largest_revenue),
        _Variant("Which region had the largest workforce at the end of {year}, counting "
                 "employees and contractors together?", _largest_workforce),
    ),
    "ratio": (
        _Variant("What was the capital expenditure per employee in {region} in {year}, in "
                 "USD thousand? Round to two decimal places.", _ratio_capex),
        _Variant("How many employees did {region} have per contractor at the end of {year}? "
                 "Round to two decimal places.", _ratio_staff),
    ),
}


def make_question(kind: str, company: Company, layout: Layout,
                  rng: random.Random) -> Question | None:
    """A question of `kind` about `company` (variants in a seeded order), or None when
    no variant fits its figures."""
    variants = list(_VARIANTS[kind])
    rng.shuffle(variants)
    for variant in variants:
        parts = variant.build(company, layout, rng)
        if parts is not None:
            fields, answer, aliases, figures, explanation = parts
            return Question(kind, variant.template.format(**fields), answer, aliases,
                            figures, explanation)
    return None


def question_max_chars() -> int:
    """An upper bound of the length of any question's text."""
    widest = {"segment": max(SEGMENTS, key=len), "region": max(REGIONS, key=len),
              "qa": QUARTERS[-1], "qb": QUARTERS[-1], "year": 9999, "prev": 9999}
    return max(len(v.template.format(**widest)) for vs in _VARIANTS.values() for v in vs)
