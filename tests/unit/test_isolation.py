"""Poison isolation's counting: which records go alone, which are refused, which skipped, and
that failures a record cannot cause count for nothing."""

from __future__ import annotations

from confluent_kafka import KafkaError

from services.dispatcher.isolation import Isolation, Verdict

A, B, C = ("ksb.i.requests.p", 0, 10), ("ksb.i.requests.p", 0, 11), ("ksb.i.inbound", 1, 5)
TOO_LARGE = KafkaError.MSG_SIZE_TOO_LARGE


def test_a_record_a_delivery_report_names_is_refused_after_two_failures_then_skipped() -> None:
    iso = Isolation(refuse_after=2)
    assert iso.failed([B], TOO_LARGE, "Broker: Message size too large", named=True)
    assert not iso.suspect([A, B, C])  # named: the batch is redone as usual
    assert iso.verdict(B) is Verdict.APPLY
    assert iso.failed([B], TOO_LARGE, "again", named=True)
    assert iso.verdict(B) is Verdict.REFUSE and iso.reason(B) == "again"
    assert iso.verdict(A) is Verdict.APPLY


def test_a_failed_batch_goes_one_by_one_and_its_poison_is_refused_then_skipped() -> None:
    """No report named a record: every record of the batch is suspect, applied alone."""
    iso = Isolation(refuse_after=2)
    assert not iso.suspect([A, B, C])
    assert iso.failed([A, B, C], TOO_LARGE, "Broker: Message size too large", named=False)
    assert iso.suspect([A]) and iso.suspect([C, ("other", 0, 0)])
    assert [iso.verdict(x) for x in (A, B, C)] == [Verdict.APPLY] * 3  # alone, once more
    iso.applied([A])
    iso.applied([C])
    assert iso.failed([B], TOO_LARGE, "again", named=False)  # B alone: it is the one
    assert not iso.suspect([A, C])
    assert iso.verdict(B) is Verdict.REFUSE and iso.reason(B) == "again"
    assert iso.failed([B], KafkaError.TOPIC_AUTHORIZATION_FAILED, "its refusal failed", named=True)
    assert iso.verdict(B) is Verdict.SKIP
    iso.applied([B])
    assert not iso.suspect([A, B, C])


def test_a_failure_kafka_causes_counts_against_no_record() -> None:
    """A broker away or a coordinator moving: the same records succeed once it is back, and an
    outage must never turn into refusals."""
    iso = Isolation(refuse_after=1)
    for code in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.NOT_COORDINATOR):
        assert not iso.failed([A], code, "outage", named=False)
    assert not iso.suspect([A]) and iso.verdict(A) is Verdict.APPLY


def test_the_records_remembered_are_bounded() -> None:
    iso = Isolation(refuse_after=2)
    iso.failed([("t", 0, n) for n in range(20_000)], TOO_LARGE, "x", named=False)
    assert not iso.suspect([("t", 0, 0)]) and iso.suspect([("t", 0, 19_999)])
