"""The engine's counters as the backend metrics the gateway exposes on /metrics (voxgate_engine_*).

From `Engine.stats_snapshot()`: per stage, batches, the requests they carried (mean batch = items /
batches) and the engine thread's seconds in the runner and on the results; the thread's other sections
(scheduling, idle, start-up); batches by the urgency rule that chose them; the codec's device seconds
(it runs on its own stream, beside the thread); requests by outcome; and slots and streams now. Chunks
that reached a listener after its audio ran out are told apart by cause: the engine's lateness, or a
stream that waited for its text (text streaming), which is the caller's. Rates and
shares come from differences between scrapes, as Prometheus does with any counter.
"""

from __future__ import annotations

import itertools

from ..base import BackendMetric


def engine_metrics(snapshot: dict, fast_path: dict[str, bool] | None = None,
                   kernel_check: dict | None = None, voice_kv: dict | None = None,
                   uncaptured: dict[str, int] | None = None) -> list[BackendMetric]:
    """`fast_path`: the runner's pieces in use (Qwen3ModelRunner.fast_path); `kernel_check`: its start-up
    kernel check's measured disagreements, when it ran; `voice_kv`: its cloned voices' prefix cache counters
    (Qwen3ModelRunner.voice_kv_stats), where it has one; `uncaptured`: its passes run without a captured graph
    while it has graphs, by kind (GraphSet.uncaptured)."""
    stages = {stage.lower(): counts for stage, counts in snapshot["stages"].items()}  # label values in lower case
    thread_seconds = [((f"runner.{stage}",), s["runner_s"]) for stage, s in stages.items()]
    thread_seconds += [((f"post.{stage}",), s["post_s"]) for stage, s in stages.items()]
    thread_seconds += [((section,), snapshot[f"{section}_s"]) for section in ("schedule", "idle", "outside_step",
                                                                             "startup")]
    rules = [((rule, stage.lower()), float(count)) for rule, by_stage in sorted(snapshot["rules"].items())
             for stage, count in sorted(by_stage.items())]
    codec = snapshot["codec"]
    text = snapshot["text"]
    extra = []
    if fast_path is not None:
        extra.append(BackendMetric("engine_fast_path", "gauge", "1 where a piece of the GPU fast path serves, 0 "
                                   "where it is off or fell back at start-up", ("piece",),
                                   tuple(((piece,), float(on)) for piece, on in fast_path.items())))
    if kernel_check is not None:
        errors = tuple(((name,), float(kernel_check[name])) for name in
                       ("talker_layer", "predictor_layer", "predictor_paired", "tail_logits"))
        extra.append(BackendMetric("engine_kernel_check_error", "gauge", "Start-up disagreement of the Triton "
                                   "kernels with the layers they replace (relative; above the limit the piece "
                                   "is turned off)", ("check",), errors))
    if uncaptured is not None:
        extra.append(BackendMetric("engine_uncaptured_passes", "counter", "Device passes run without a captured "
                                   "CUDA graph while the runner has graphs (no captured shape fit them), by kind: "
                                   "each launched all its kernels from the engine thread", ("kind",),
                                   tuple(((kind,), float(n)) for kind, n in sorted(uncaptured.items()))))
    if voice_kv is not None:
        extra += [
            BackendMetric("engine_voice_kv_requests", "counter", "Requests in a cloned voice with a cacheable prompt "
                          "prefix, by whether its K/V came from the cache (hit) or was prefilled (miss)", ("result",),
                          ((("hit",), float(voice_kv["hits"])), (("miss",), float(voice_kv["misses"])))),
            BackendMetric("engine_voice_kv_positions_saved", "counter", "Prompt positions not prefilled because "
                          "their K/V came from the voice cache", samples=(((), float(voice_kv["positions_saved"])),)),
            BackendMetric("engine_voice_kv_evictions", "counter", "Voice prefixes dropped to stay within the cache's "
                          "bytes", samples=(((), float(voice_kv["evictions"])),)),
            BackendMetric("engine_voice_kv_bytes", "gauge", "Device bytes of voice prefix K/V held now",
                          samples=(((), float(voice_kv["bytes"])),)),
            BackendMetric("engine_voice_kv_entries", "gauge", "Voice prefixes held now",
                          samples=(((), float(voice_kv["entries"])),)),
        ]
    return extra + [
        BackendMetric("engine_decisions", "counter", "Scheduling decisions of the engine thread (one per batch)",
                      samples=(((), float(snapshot["decisions"])),)),
        BackendMetric("engine_decide_calls", "counter", "Calls of the scheduler's decision (those that found "
                      "nothing to run included)", samples=(((), float(snapshot["decide_calls"])),)),
        BackendMetric("engine_decide_cpu_seconds", "counter", "CPU seconds of the engine thread inside the "
                      "scheduler's decisions (the schedule section's wall seconds also hold the command drain and "
                      "waits for the interpreter lock)", samples=(((), snapshot["decide_cpu_s"]),)),
        BackendMetric("engine_batches", "counter", "Batches run, by stage", ("stage",),
                      tuple(((stage,), float(s["batches"])) for stage, s in stages.items())),
        BackendMetric("engine_batch_items", "counter", "Requests carried by batches, by stage (mean batch: "
                      "items / batches)", ("stage",), tuple(((stage,), float(s["items"])) for stage, s in stages.items())),
        BackendMetric("engine_thread_seconds", "counter", "Wall seconds of the engine thread by section (runner.* "
                      "in a stage's runner call, post.* on its results, schedule, idle, outside_step, startup); "
                      "the sections add up to the thread's time", ("section",), tuple(thread_seconds)),
        BackendMetric("engine_rule_batches", "counter", "Batches by the urgency rule that chose them",
                      ("rule", "stage"), tuple(rules)),
        BackendMetric("engine_codec_device_seconds", "counter", "Device seconds of codec batches (on their own "
                      "stream, overlapping generation; measured where the runner times them)",
                      samples=(((), codec["device_s"]),)),
        BackendMetric("engine_codec_collected", "counter", "Codec batches collected",
                      samples=(((), float(codec["collected"])),)),
        BackendMetric("engine_requests", "counter", "Requests that left the engine, by outcome", ("outcome",),
                      tuple(((outcome,), float(snapshot[outcome])) for outcome in ("completed", "cancelled", "failed"))),
        BackendMetric("engine_late_chunks", "counter", "Chunks emitted after the stream's listener ran out of audio, "
                      "by cause: the engine was late, or the stream waited for its text (the caller's silence)",
                      ("cause",), ((("engine",), float(snapshot["late_chunks"])), (("text",), float(text["gaps"])))),
        BackendMetric("engine_late_seconds", "counter", "How long listeners were out of audio before those chunks, "
                      "by cause", ("cause",), ((("engine",), snapshot["late_s"]), (("text",), text["gap_s"]))),
        BackendMetric("engine_trimmed_requests", "counter", "Requests whose leading audio was partly dropped as "
                      "silence before their first audible window", samples=(((), float(snapshot["trimmed"]["requests"])),)),
        BackendMetric("engine_trimmed_seconds", "counter", "Leading audio dropped as silence, all requests: each "
                      "frame of it delayed a request's first audio by a frame", samples=(((), snapshot["trimmed"]["seconds"]),)),
        BackendMetric("engine_first_chunks", "counter", "Requests' first chunks by how long after the request "
                      "reached the engine they shipped, cumulative per upper bound le in seconds as a Prometheus "
                      "histogram's buckets (a text-streaming request's wait for its text included)", ("le",),
                      tuple(((le,), float(count)) for le, count in
                            zip(snapshot["first_chunks"], itertools.accumulate(snapshot["first_chunks"].values())))),
        BackendMetric("engine_text_waits", "counter", "Times a stream's next step needed text not yet pushed "
                      "(it waits outside the batches)", samples=(((), float(text["waits"])),)),
        BackendMetric("engine_text_wait_seconds", "counter", "Stream-seconds spent waiting for text",
                      samples=(((), text["wait_s"]),)),
        BackendMetric("engine_streams_waiting_for_text", "gauge", "Streams waiting for their text now",
                      samples=(((), float(text["waiting"])),)),
        BackendMetric("engine_slots", "gauge", "KV slots (requests generating at once)",
                      samples=(((), float(snapshot["slots"])),)),
        BackendMetric("engine_slots_in_use", "gauge", "KV slots held by requests now",
                      samples=(((), float(snapshot["slots_in_use"])),)),
        BackendMetric("engine_streams", "gauge", "Requests in the engine now (holding a slot or queued for one)",
                      samples=(((), float(snapshot["streams"])),)),
    ]
