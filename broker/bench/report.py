"""What `kvbroker bench` prints without --json: the table (the targets: broker.bench.targets)."""

from __future__ import annotations

from typing import Any


def format_table(records: list[dict[str, Any]]) -> str:
    header = (
        f"{'batch':>5} {'streams':>7} {'journal':<7} {'events/s':>10} {'echo ev/s':>10} {'ratio':>6} "
        f"{'p50@50':>7} {'p99@50':>7} {'p999@50':>8} {'echo99@50':>9} {'p50@90':>7} {'p99@90':>7} {'p999@90':>8} {'cpu_us/ev':>9} "
        f"{'peak_rss':>9}"
    )
    lines = [header, "-" * len(header)]

    def ms(value: float | None, width: int) -> str:
        return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"

    for r in records:
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}MiB" if r["peak_rss_bytes"] else "-"
        echo = f"{r['echo_events_per_s']:,.0f}" if r["echo_events_per_s"] else "-"
        ratio = f"{r['ratio_to_echo']:.2f}" if r["ratio_to_echo"] is not None else "-"
        cpu = f"{r['cpu_us_per_event']:.1f}" if r["cpu_us_per_event"] is not None else "-"
        lines.append(
            f"{r['batch']:>5} {r['streams']:>7} {r['journal']:<7} {r['events_per_s']:>10,.0f} {echo:>10} {ratio:>6} "
            f"{ms(r['p50_ms'], 7)} {ms(r['p99_ms'], 7)} {ms(r['p999_ms'], 8)} {ms(r.get('echo_p99_ms_at_50'), 9)} "
            f"{ms(r['p50_ms_at_90'], 7)} {ms(r['p99_ms_at_90'], 7)} "
            f"{ms(r['p999_ms_at_90'], 8)} {cpu:>9} {rss:>9}"
        )
    return "\n".join(lines)
