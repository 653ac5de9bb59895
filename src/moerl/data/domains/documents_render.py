"""Pages of a company report: narrative around the tables, within a character budget.

A page prints as blocks separated by a blank line:

    --- Page 2 ---
    Risks
    <sentences>
    <tables placed on this page>
    <more sentences>

Page 1's heading is "<company>: annual report <year>"; later pages carry a section
heading (management discussion, risks, outlook, operations). The narrative sentences
mention figures of their own (dividends, backlog, research spending, ...), never the
figures of the tables or of the previous year's employees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from moerl.data.domains.documents_company import (
    BLOCKS,
    QUARTERS,
    Company,
    Layout,
    render_block,
    thousands,
)

_SENTENCES: dict[str, tuple[str, ...]] = {
    "Overview": (
        "{company} closed {year} with {adj} demand across its {segment} and {segment2} "
        "businesses.",
        "The board proposed a dividend of USD {dps} per share for {year}.",
        "Order backlog stood at USD {money} thousand at year end, {trend} on a year earlier.",
        "The company served {count} enterprise customers, {pct}% of them outside {region}.",
        "Net debt ended the year at USD {money} thousand after repayments of USD {money2} "
        "thousand.",
        "Management thanks the teams in {region} and {region2} for a {adj} year.",
    ),
    "Management discussion": (
        "Gross margin in {segment} moved by {points} percentage points as input prices "
        "{moved}.",
        "Research and development spending reached USD {money} thousand, {pct}% above plan.",
        "Marketing expenses of USD {money} thousand focused on {region} and {region2}.",
        "Pricing actions in {segment} took effect in {quarter} and held through year end.",
        "Customer retention in {segment} stood at {share}%, while churn in {region} was {adj}.",
        "Working capital improved as receivable days fell to {days}.",
    ),
    "Risks": (
        "Currency movements in {region} could reduce reported results by up to {pct}%.",
        "Components for {segment} come from {count} suppliers, {small} of them critical.",
        "A cyber incident in {quarter} was contained within {hours} hours without data loss.",
        "Regulatory changes in {region} may add compliance costs of about USD {money} "
        "thousand a year.",
        "Interest on floating-rate debt rose to {rate}% and may rise further in {next}.",
        "Demand in {segment} remains {adj} and sensitive to customer budgets.",
    ),
    "Outlook": (
        "For {next}, management expects {adj} growth in {segment} and stable demand in "
        "{region}.",
        "The company plans to open {small} new sites in {region} during {next}.",
        "Guidance assumes exchange rates {trend} and inflation of about {rate}%.",
        "A share buyback of up to USD {money} thousand is planned for {next}.",
        "Investment priorities for {next} are automation, {segment} products and training.",
        "Progress on these goals will be reported in the interim statement for {next}.",
    ),
    "Operations": (
        "Energy use fell {pct}% as sites in {region} moved to renewable power.",
        "On-time delivery for {segment} customers reached {share}% in {quarter}.",
        "The company completed {small} acquisitions worth USD {money} thousand in total.",
        "Training averaged {hours} hours per person across all regions.",
        "Warehouse space in {region} grew by {count} square meters.",
        "Quality audits at {small} plants in {region} found no major issues.",
    ),
}
SECTIONS = tuple(s for s in _SENTENCES if s != "Overview")
_ADJECTIVES = ("steady", "resilient", "uneven", "robust", "modest", "cautious", "firm")
_TRENDS = ("up", "down", "flat", "slightly up", "slightly down")
_MOVES = ("eased", "rose", "stabilised", "fluctuated")


def page_marker(page: int) -> str:
    return f"--- Page {page} ---"


def first_heading(company: Company) -> str:
    return f"{company.name}: annual report {company.year}"


def _sentence(template: str, company: Company, rng: random.Random) -> str:
    segment, segment2 = rng.sample(company.segments, 2)
    region, region2 = rng.sample(company.regions, 2)
    return template.format(
        company=company.name, year=company.year, next=company.year + 1, segment=segment,
        segment2=segment2, region=region, region2=region2, adj=rng.choice(_ADJECTIVES),
        trend=rng.choice(_TRENDS), moved=rng.choice(_MOVES), quarter=rng.choice(QUARTERS),
        dps=f"{rng.randint(5, 250) / 100:.2f}", money=thousands(rng.randint(150, 9999)),
        money2=thousands(rng.randint(100, 4999)), count=rng.randint(20, 900),
        pct=f"{rng.randint(5, 400) / 10:.1f}", days=rng.randint(28, 75),
        hours=rng.randint(4, 60), small=rng.randint(2, 9),
        rate=f"{rng.randint(15, 95) / 10:.1f}", points=f"{rng.randint(3, 40) / 10:.1f}",
        share=f"{rng.randint(800, 995) / 10:.1f}")


@dataclass
class _Page:
    number: int
    heading: str
    before: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)

    def text(self) -> str:
        blocks = [page_marker(self.number), self.heading, " ".join(self.before),
                  *self.tables, " ".join(self.after)]
        return "\n\n".join(b for b in blocks if b)

    def content_chars(self) -> int:
        """Characters below the page marker."""
        return len(self.text()) - len(page_marker(self.number)) - 2


class _Templates:
    """Sentence templates for a document, each used once before any repeats."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._unused = {s: list(t) for s, t in _SENTENCES.items()}

    def draw(self, section: str) -> str:
        pool = self._unused[section] or [t for ts in self._unused.values() for t in ts]
        if not pool:
            self._unused = {s: list(t) for s, t in _SENTENCES.items()}
            pool = self._unused[section]
        template = self._rng.choice(pool)
        for templates in self._unused.values():
            if template in templates:
                templates.remove(template)
        return template


def render_pages(company: Company, layout: Layout, pages: int, target_chars: int,
                 budget: int, rng: random.Random) -> list[str]:
    """The text of each page. Every block of `layout` lands on its page; narrative fills
    each page to at most `target_chars` below its marker, while all pages joined by a
    blank line stay within `budget` characters. ValueError when the blocks alone exceed
    `budget`."""
    sections = list(SECTIONS)
    rng.shuffle(sections)
    built = [_Page(1, first_heading(company))]
    built += [_Page(n, sections[(n - 2) % len(sections)]) for n in range(2, pages + 1)]
    for block in BLOCKS:
        page = built[layout[block] - 1]
        text = render_block(company, block)
        (page.before if block == "prior_employees" else page.tables).append(text)
    total = sum(len(p.text()) for p in built) + 2 * (pages - 1)
    if total > budget:
        raise ValueError(f"the report's tables need {total} characters, over the budget "
                         f"of {budget}")
    templates = _Templates(rng)
    for page in built:
        section = "Overview" if page.number == 1 else page.heading
        misses = 0
        while misses < 3:
            side = page.after if page.tables and rng.random() < 0.5 else page.before
            before = len(page.text())
            side.append(_sentence(templates.draw(section), company, rng))
            grown = len(page.text()) - before
            if page.content_chars() <= target_chars and total + grown <= budget:
                total += grown
                misses = 0
            else:
                side.pop()
                misses += 1
        if layout["prior_employees"] == page.number:  # the fact sentence among the others
            fact = page.before.pop(0)
            page.before.insert(rng.randint(0, len(page.before)), fact)
    return [p.text() for p in built]


def heading_max_chars(widest: Company) -> int:
    """An upper bound of a page heading's length, given the widest company."""
    return max(len(first_heading(widest)), *map(len, SECTIONS))
