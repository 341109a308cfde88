"""What a check found: one row per check (pass or fail, the measured number and the bound it was held to), and the
table `sftflow check` prints."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CheckRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    passed: bool
    measured: str  # the number(s) the check measured, as shown
    bound: str  # what it was held to
    detail: str = ""  # where it failed, or what was not compared and why
    required: bool = True  # False: reported ("differs"), but does not fail the check

    @property
    def result(self) -> str:
        if self.passed:
            return "PASS"
        return "FAIL" if self.required else "differs"


class CheckReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    rows: list[CheckRow]

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows if row.required)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def table(self) -> str:
        """A plain-text table, one check a line, then each row's detail under it."""
        header = ("check", "result", "measured", "bound")
        cells = [header] + [(r.name, r.result, r.measured, r.bound) for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = []
        for k, row in enumerate(cells):
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * width for width in widths))
            elif self.rows[k - 1].detail:
                lines.append(f"    {self.rows[k - 1].detail}")
        failed = sum(not r.passed for r in self.rows if r.required)
        verdict = f"{failed} check(s) FAILED" if failed else "all checks pass"
        return "\n".join([*lines, "", verdict])

    def markdown(self) -> str:
        lines = ["| check | result | measured | bound | detail |", "|---|---|---|---|---|"]
        for r in self.rows:
            result = "**FAIL**" if r.result == "FAIL" else r.result.lower()
            lines.append(f"| {r.name} | {result} | {r.measured} | {r.bound} | {r.detail} |")
        return "\n".join(lines)
