"""The figures of a fictional company's annual report and the blocks that show them.

A company has three business segments and three regions. Its report shows seven
blocks, each placed on one page (`Layout`):

    revenue_h1       table: revenue per segment, Q1 and Q2 (USD thousand)
    revenue_h2       table: revenue per segment, Q3 and Q4 (USD thousand)
    costs            table: operating costs per segment, Q1 to Q4 (USD thousand)
    employees        table: employees per region at year end
    contractors      table: contractors per region at year end
    capex            table: capital expenditure per region (USD thousand)
    prior_employees  sentence: employees per region at the end of the previous year

A table renders as its title line, a header line and one line per row:

    Revenue by segment, first half 2023 (USD thousand)
    | Segment | Q1 | Q2 |
    | Cloud Services | 1,234 | 2,345 |
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

SEGMENTS = (
    "Cloud Services", "Industrial Sensors", "Consumer Devices", "Freight Logistics",
    "Payments", "Healthcare Software", "Renewable Energy", "Specialty Chemicals",
    "Retail Banking", "Data Analytics", "Medical Imaging", "Agricultural Machinery",
)
REGIONS = (
    "North America", "Western Europe", "Asia Pacific", "Latin America", "Middle East",
    "Nordics", "Japan", "India", "Oceania", "Central Europe",
)
_NAME_STEMS = ("Northwind", "Bluepeak", "Halvorsen", "Ostrava", "Caldera", "Meridian",
               "Tessaro", "Quillon", "Brightwater", "Kestrel", "Vantora", "Larchmont")
_NAME_ENDINGS = ("Industries", "Holdings", "Systems", "Group", "Technologies", "Partners")
COMPANY_NAMES = tuple(f"{stem} {ending}" for stem in _NAME_STEMS for ending in _NAME_ENDINGS)

QUARTERS = ("Q1", "Q2", "Q3", "Q4")
BLOCKS = ("revenue_h1", "revenue_h2", "costs", "employees", "contractors", "capex",
          "prior_employees")
TABLES = BLOCKS[:-1]

_YEARS = (2016, 2024)
_REVENUE = (400, 4999)
_EMPLOYEES = (60, 990)
_CONTRACTORS = (10, 390)
_CAPEX = (120, 3999)
_PRIOR_EMPLOYEES_MAX = 1299


@dataclass(frozen=True)
class Company:
    """One report's figures: money in USD thousand, people as head counts."""

    name: str
    year: int
    segments: tuple[str, ...]
    regions: tuple[str, ...]
    revenue: dict[str, tuple[int, ...]]
    """segment -> revenue of Q1..Q4"""
    costs: dict[str, tuple[int, ...]]
    """segment -> operating costs of Q1..Q4, each below that quarter's revenue"""
    employees: dict[str, int]
    contractors: dict[str, int]
    capex: dict[str, int]
    prior_employees: dict[str, int]
    """region -> employees at the end of the previous year"""


Layout = dict[str, int]
"""block name (one of BLOCKS) -> its page, 1-based."""


@dataclass(frozen=True)
class Figure:
    """Where a number stands: in `table` (a title line) at `row` and `column`, or, for a
    sentence (`table` None), in the clause `context`; `value` is the number as printed."""

    page: int
    table: str | None
    row: str
    column: str
    value: str
    context: str | None = None


def thousands(value: int) -> str:
    """`value` as the report prints it: 1234 -> "1,234"."""
    return f"{value:,}"


def make_company(rng: random.Random) -> Company:
    segments = tuple(rng.sample(SEGMENTS, 3))
    regions = tuple(rng.sample(REGIONS, 3))
    revenue = {s: tuple(rng.randint(*_REVENUE) for _ in QUARTERS) for s in segments}
    costs = {s: tuple(round(r * rng.uniform(0.55, 0.92)) for r in revenue[s]) for s in segments}
    employees = {r: rng.randint(*_EMPLOYEES) for r in regions}
    prior = {r: min(_PRIOR_EMPLOYEES_MAX, round(employees[r] * rng.uniform(0.75, 1.3)))
             for r in regions}
    return Company(
        name=rng.choice(COMPANY_NAMES), year=rng.randint(*_YEARS), segments=segments,
        regions=regions, revenue=revenue, costs=costs, employees=employees,
        contractors={r: rng.randint(*_CONTRACTORS) for r in regions},
        capex={r: rng.randint(*_CAPEX) for r in regions}, prior_employees=prior)


def widest_company() -> Company:
    """A company whose every block prints at least as long as any `make_company` block:
    the longest names and the widest numbers (for size bounds, not for prompts)."""
    segments = tuple(sorted(SEGMENTS, key=len, reverse=True)[:3])
    regions = tuple(sorted(REGIONS, key=len, reverse=True)[:3])
    top = _REVENUE[1]
    return Company(
        name=max(COMPANY_NAMES, key=len), year=_YEARS[1], segments=segments, regions=regions,
        revenue={s: (top,) * 4 for s in segments}, costs={s: (top,) * 4 for s in segments},
        employees=dict.fromkeys(regions, _EMPLOYEES[1]),
        contractors=dict.fromkeys(regions, _CONTRACTORS[1]),
        capex=dict.fromkeys(regions, _CAPEX[1]),
        prior_employees=dict.fromkeys(regions, _PRIOR_EMPLOYEES_MAX))


def make_layout(pages: int, rng: random.Random) -> Layout:
    """A page for every block such that each question's two sources differ: the two
    revenue halves, employees against contractors, capital expenditure and the
    previous year's employees. Costs go anywhere (they differ from one revenue half).
    Of a few random layouts, the one crowding the fewest blocks on one page."""
    drawn = [_random_layout(pages, rng) for _ in range(4)]
    return min(drawn, key=lambda layout: max(Counter(layout.values()).values()))


def _random_layout(pages: int, rng: random.Random) -> Layout:
    every = range(1, pages + 1)
    first_half = rng.choice(every)
    employees = rng.choice(every)
    not_employees = [p for p in every if p != employees]
    return {
        "revenue_h1": first_half,
        "revenue_h2": rng.choice([p for p in every if p != first_half]),
        "costs": rng.choice(every),
        "employees": employees,
        "contractors": rng.choice(not_employees),
        "capex": rng.choice(not_employees),
        "prior_employees": rng.choice(not_employees),
    }


def _table_shape(company: Company, block: str) -> tuple[str, str, tuple[str, ...],
                                                        dict[str, tuple[int, ...]]]:
    """(title, row header, column names, row name -> values) of a table block."""
    year, regions = company.year, company.regions
    if block == "revenue_h1":
        return (f"Revenue by segment, first half {year} (USD thousand)", "Segment",
                QUARTERS[:2], {s: v[:2] for s, v in company.revenue.items()})
    if block == "revenue_h2":
        return (f"Revenue by segment, second half {year} (USD thousand)", "Segment",
                QUARTERS[2:], {s: v[2:] for s, v in company.revenue.items()})
    if block == "costs":
        return (f"Operating costs by segment, {year} (USD thousand)", "Segment", QUARTERS,
                dict(company.costs))
    if block == "employees":
        return (f"Employees by region at the end of {year}", "Region", ("Employees",),
                {r: (company.employees[r],) for r in regions})
    if block == "contractors":
        return (f"Contractors by region at the end of {year}", "Region", ("Contractors",),
                {r: (company.contractors[r],) for r in regions})
    if block == "capex":
        return (f"Capital expenditure by region, {year} (USD thousand)", "Region",
                ("Capex",), {r: (company.capex[r],) for r in regions})
    raise ValueError(f"{block!r} is not a table block (one of {TABLES})")


def _prior_clause(company: Company, region: str) -> str:
    return f"{thousands(company.prior_employees[region])} in {region}"


def render_block(company: Company, block: str) -> str:
    """The printed text of `block`: a table (title, header, rows) or the sentence."""
    if block == "prior_employees":
        clauses = [_prior_clause(company, r) for r in company.regions]
        return (f"At the end of {company.year - 1} the company employed "
                f"{clauses[0]}, {clauses[1]} and {clauses[2]}.")
    title, row_header, columns, rows = _table_shape(company, block)
    lines = [title, "| " + " | ".join((row_header, *columns)) + " |"]
    lines += ["| " + " | ".join((name, *map(thousands, values))) + " |"
              for name, values in rows.items()]
    return "\n".join(lines)


def figure(company: Company, layout: Layout, block: str, row: str, column: str) -> Figure:
    """The figure of `block` at `row` and `column` (for the sentence: row = a region)."""
    page = layout[block]
    if block == "prior_employees":
        value = company.prior_employees[row]
        return Figure(page, None, row, "previous year employees", thousands(value),
                      _prior_clause(company, row))
    title, _, columns, rows = _table_shape(company, block)
    return Figure(page, title, row, column, thousands(rows[row][columns.index(column)]))
