"""flashlab.instruments.ring_overlap reads the send/compute order off a compiled schedule (no devices)."""
from flashlab.instruments.ring_overlap import schedule, send_overlap

ASYNC = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %conditional.1 = (f32[4]{0}) conditional(%pred, %x, %x), true_computation=%a, false_computation=%b
  %fusion.2 = f32[4]{0} fusion(%conditional.1), kind=kLoop, calls=%f
  %done = f32[4]{0} collective-permute-done(%start)
  ROOT %t = (s32[], f32[4]) tuple(%i, %done)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %cp = f32[4]{0} collective-permute(%a), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %fusion.9 = f32[4]{0} fusion(%a), kind=kLoop, calls=%g
  ROOT %add = f32[4]{0} add(%cp, %fusion.9)
}
"""


def test_async_pair_and_sync_send():
    comps = schedule(ASYNC)
    assert set(comps) == {"body", "main"}
    rows = {r["send"]: r for r in send_overlap(ASYNC)}
    a, s = rows["start"], rows["cp"]
    assert a["kind"] == "async" and a["needed_by"] == "collective-permute-done"
    assert a["compute_between"] == ["conditional.1", "fusion.2"]
    assert s["kind"] == "sync" and s["needed_by"] == "add" and s["compute_between"] == ["fusion.9"]
