"""A reward plug-in (reward.function) for the learning test: one point for every "7" in a
response. The learning test's model (tests/helpers/char_model.py) writes each character as a
token of its own, so this pays for one target token."""

TARGET = "7"


def pay_for_target(response: str, label: str, metadata: dict) -> float:
    return float(response.count(TARGET))
