"""The fixed prompts of `tokenmill bench speculative`: input-grounded tasks, whose answers repeat much
of their input (code edits, extraction, summaries: where prompt lookup pays), and open-ended ones,
whose answers do not (where speculation must cost nothing). Written here so that every run, on every
machine, measures the same work."""
from __future__ import annotations

_INVENTORY = '''\
def summarize_inventory(items):
    totals = {}
    for item in items:
        name = item["name"]
        count = item["count"]
        price = item["price"]
        if name not in totals:
            totals[name] = {"count": 0, "value": 0.0}
        totals[name]["count"] += count
        totals[name]["value"] += count * price
    report = []
    for name, entry in sorted(totals.items()):
        report.append(f"{name}: {entry['count']} units, worth {entry['value']:.2f}")
    return "\\n".join(report)


def find_low_stock(items, threshold):
    low = []
    for item in items:
        if item["count"] < threshold:
            low.append(item["name"])
    return low
'''

_CONFIG_LOADER = '''\
import json
import os


def load_settings(path):
    with open(path) as f:
        data = json.load(f)
    settings = {}
    settings["host"] = data.get("host", "localhost")
    settings["port"] = int(data.get("port", 8080))
    settings["debug"] = bool(data.get("debug", False))
    settings["workers"] = int(data.get("workers", 4))
    settings["log_file"] = data.get("log_file", "server.log")
    if os.environ.get("APP_PORT"):
        settings["port"] = int(os.environ["APP_PORT"])
    if os.environ.get("APP_DEBUG"):
        settings["debug"] = os.environ["APP_DEBUG"] == "1"
    return settings
'''

_MEETING = '''\
Minutes of the planning meeting, 14 March. Present: Alice Moreau (chair), Ben Okafor, Carla Jensen,
David Liu and Emma Rossi. Alice opened the meeting at 9:30 and reviewed the actions from February.
Ben reported that the warehouse move is on schedule: the new site in Leeds will open on 2 May, and
the lease for the old site in Bradford ends on 31 May. Carla presented the budget: spending is 4%
under plan for the quarter, mostly because the new delivery vans arrived late. David raised the
problem of the customer portal, which was down for six hours on 9 March; the cause was an expired
certificate, and he proposed automatic renewal, which the meeting approved. Emma asked for two more
people in the support team before the summer; Alice agreed to hire one now and review the second in
June. Actions: Ben to send the moving plan to all staff by 21 March; Carla to circulate the revised
budget by 28 March; David to set up certificate renewal by 1 April; Emma to write the job description
by 18 March. The next meeting is on 11 April at 9:30 in the Leeds office.'''

_ARTICLE = '''\
The town of Alder Creek voted on Tuesday to rebuild its old stone bridge rather than replace it with a
modern concrete one. The bridge, built in 1874, carries the main road over the creek and is used by
about four thousand vehicles a day. Engineers found last year that two of its arches had cracked, and
heavy lorries have been banned from it since October. The council considered two plans. The first,
a new concrete bridge, would cost 3.2 million dollars and take eighteen months to build. The second,
restoring the stone bridge and strengthening its arches with steel, would cost 4.1 million dollars
and take two years, but would keep a landmark that appears on the town's seal. After a public
meeting attended by more than three hundred residents, the council chose restoration by six votes to
one. The mayor, Ruth Calder, said the extra cost would be covered partly by a state heritage grant of
1.5 million dollars. Work is expected to start in the spring, and a temporary bridge will carry traffic
while the arches are repaired.'''

GROUNDED: dict[str, str] = {
    "code-rename": "Rename the function summarize_inventory to build_inventory_report and the variable "
                   "totals to per_item in this Python code. Reply with the complete code only.\n\n" + _INVENTORY,
    "code-typehints": "Add type hints to every function in this Python code, changing nothing else. Reply "
                      "with the complete code only.\n\n" + _CONFIG_LOADER,
    "code-logging": "Rewrite this code so that it uses a logger named log instead of nothing: add "
                    "`log.info` after each setting is read. Reply with the complete code.\n\n" + _CONFIG_LOADER,
    "extract-actions": "List every action from these minutes, one per line, as: person - task - "
                       "deadline.\n\n" + _MEETING,
    "extract-people": "Quote every sentence of these minutes that names a person, one per line, "
                      "exactly as written.\n\n" + _MEETING,
    "summary-article": "Summarize this article in a few sentences, keeping the figures.\n\n" + _ARTICLE,
    "quote-article": "Copy the sentences of this article that contain a number, exactly as written, "
                     "one per line.\n\n" + _ARTICLE,
}

OPEN_ENDED: dict[str, str] = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "explain": "Explain why the sky is blue to a ten-year-old.",
    "advice": "What are some good ways to learn a new language as an adult?",
    "poem": "Write a poem about autumn in a small mountain village.",
}


def all_prompts() -> dict[str, tuple[str, str]]:
    """name -> (kind, text), kind "grounded" or "open"."""
    return {**{k: ("grounded", v) for k, v in GROUNDED.items()}, **{k: ("open", v) for k, v in OPEN_ENDED.items()}}
