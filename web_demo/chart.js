// A small live timeline on a canvas: one row per sentence, time since Speak on the x axis.
// Per sentence: grey while its text is complete but no audio has come back, amber from its first audio
// byte until it starts playing (jitter buffer and the sentences queued ahead of it), indigo while it
// plays; a red cap marks audio cut by an interrupt.

const COLORS = {
  text: "#0f172a",
  muted: "#64748b",
  grid: "#e2e8f0",
  wait: "#cbd5e1",
  buffer: "#f59e0b",
  play: "#4f46e5",
  cut: "#dc2626",
  now: "#0ea5e9",
};

const NICE_STEPS_MS = [50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 30000, 60000];

export class TimelineChart {
  constructor(canvas) {
    this.canvas = canvas;
    this.context = canvas.getContext("2d");
    this.span = 2000; // ms shown; grows smoothly, never shrinks within an utterance
  }

  reset() {
    this.span = 2000;
  }

  #fit() {
    const ratio = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth;
    const height = this.canvas.clientHeight;
    if (this.canvas.width !== Math.round(width * ratio) || this.canvas.height !== Math.round(height * ratio)) {
      this.canvas.width = Math.round(width * ratio);
      this.canvas.height = Math.round(height * ratio);
    }
    this.context.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { width, height };
  }

  draw(utterance, nowMs) {
    const { width, height } = this.#fit();
    const g = this.context;
    g.clearRect(0, 0, width, height);
    const left = 40;
    const right = 14;
    const top = 10;
    const axis = 24;
    const plotWidth = width - left - right;
    const plotHeight = height - top - axis;
    if (plotWidth <= 0 || plotHeight <= 0) return; // a canvas laid out with no room (hidden, collapsed)
    const live = !utterance.outcome;
    const end = live ? nowMs : utterance.endedAt ?? nowMs;

    let latest = end;
    for (const s of utterance.sentences) {
      if (s.playAt !== null) latest = Math.max(latest, Math.min(s.playAt + durationMs(s), live ? nowMs : Infinity));
    }
    while (latest * 1.08 > this.span) this.span *= 1.5;
    const x = (t) => left + (Math.max(0, t) / this.span) * plotWidth;

    // Grid and time axis.
    // At most one label per 70 px (a phone gets fewer), never more than 8.
    const ticks = Math.max(2, Math.min(8, Math.floor(plotWidth / 70)));
    const step = NICE_STEPS_MS.find((candidate) => this.span / candidate <= ticks) ?? 120000;
    g.font = "11px Inter, system-ui, sans-serif";
    g.textBaseline = "top";
    g.textAlign = "center";
    for (let t = 0; t <= this.span; t += step) {
      g.strokeStyle = COLORS.grid;
      g.lineWidth = 1;
      g.beginPath();
      g.moveTo(Math.round(x(t)) + 0.5, top);
      g.lineTo(Math.round(x(t)) + 0.5, top + plotHeight);
      g.stroke();
      g.fillStyle = COLORS.muted;
      // The last label would be cut at the edge: right-align it there.
      g.textAlign = x(t) + 24 > width ? "right" : "center";
      g.fillText(step >= 1000 ? `${t / 1000} s` : `${t} ms`, g.textAlign === "right" ? width - 2 : x(t), top + plotHeight + 6);
    }

    const rows = Math.max(utterance.sentences.length, 4);
    const rowHeight = Math.min(28, plotHeight / rows);
    const barHeight = Math.max(4, Math.min(14, rowHeight * 0.55));

    utterance.sentences.forEach((s, row) => {
      const y = top + row * rowHeight + (rowHeight - barHeight) / 2;
      g.fillStyle = COLORS.muted;
      g.textAlign = "right";
      g.textBaseline = "middle";
      g.fillText(`S${s.number}`, left - 8, y + barHeight / 2);

      const firstAudio = s.firstAudioAt ?? (live ? nowMs : null);
      if (s.textReadyAt !== null && firstAudio !== null && firstAudio > s.textReadyAt) {
        bar(g, x(s.textReadyAt), y, x(firstAudio) - x(s.textReadyAt), barHeight, COLORS.wait);
      }
      if (s.firstAudioAt !== null) {
        const playStart = s.playAt ?? (live ? nowMs : utterance.endedAt ?? nowMs);
        if (playStart > s.firstAudioAt) bar(g, x(s.firstAudioAt), y, x(playStart) - x(s.firstAudioAt), barHeight, COLORS.buffer);
        g.fillStyle = COLORS.buffer;
        g.beginPath();
        g.arc(x(s.firstAudioAt), y + barHeight / 2, barHeight / 2 + 1, 0, Math.PI * 2);
        g.fill();
      }
      if (s.playAt !== null) {
        let playEnd = s.playAt + durationMs(s);
        if (live) playEnd = Math.min(playEnd, nowMs);
        if (utterance.interruptedAt !== undefined) playEnd = Math.min(playEnd, utterance.interruptedAt);
        if (playEnd > s.playAt) bar(g, x(s.playAt), y, x(playEnd) - x(s.playAt), barHeight, COLORS.play);
        if (s.cut && utterance.interruptedAt !== undefined && s.playAt + durationMs(s) > utterance.interruptedAt) {
          g.fillStyle = COLORS.cut;
          g.fillRect(x(playEnd) - 1, y - 2, 3, barHeight + 4);
        }
      }
    });

    if (!utterance.sentences.length) {
      g.fillStyle = COLORS.muted;
      g.textAlign = "left";
      g.textBaseline = "middle";
      g.fillText(live ? "waiting for the first sentence…" : "no audio", left + 8, top + rowHeight / 2);
    }

    if (utterance.interruptedAt !== undefined) {
      g.strokeStyle = COLORS.cut;
      g.setLineDash([4, 3]);
      g.beginPath();
      g.moveTo(x(utterance.interruptedAt) + 0.5, top);
      g.lineTo(x(utterance.interruptedAt) + 0.5, top + plotHeight);
      g.stroke();
      g.setLineDash([]);
      g.fillStyle = COLORS.cut;
      g.textAlign = "left";
      g.textBaseline = "top";
      g.fillText("barge-in", x(utterance.interruptedAt) + 4, top);
    }
    if (live) {
      g.strokeStyle = COLORS.now;
      g.beginPath();
      g.moveTo(x(nowMs) + 0.5, top);
      g.lineTo(x(nowMs) + 0.5, top + plotHeight);
      g.stroke();
    }
  }
}

function durationMs(sentence) {
  return (sentence.samples / sentence.sampleRate) * 1000;
}

function bar(g, x, y, width, height, color) {
  const w = Math.max(width, 1);
  const radius = Math.max(0, Math.min(3, height / 2, w / 2)); // roundRect throws on a negative radius
  g.fillStyle = color;
  g.beginPath();
  g.roundRect(x, y, w, height, radius);
  g.fill();
}

// The jitter buffer's level over the last few seconds, with the pre-roll target as a dashed line and a
// red tick at each underrun.
export class BufferSparkline {
  constructor(canvas, { windowMs = 8000 } = {}) {
    this.canvas = canvas;
    this.context = canvas.getContext("2d");
    this.windowMs = windowMs;
    this.points = []; // {t, bufferedMs, underruns}
  }

  push(t, stats) {
    this.points.push({ t, bufferedMs: stats.bufferedMs, underruns: stats.underruns });
    while (this.points.length && this.points[0].t < t - this.windowMs - 1000) this.points.shift();
  }

  draw(nowMs, prerollMs) {
    const ratio = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth;
    const height = this.canvas.clientHeight;
    if (this.canvas.width !== Math.round(width * ratio)) this.canvas.width = Math.round(width * ratio);
    if (this.canvas.height !== Math.round(height * ratio)) this.canvas.height = Math.round(height * ratio);
    const g = this.context;
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const top = 14;
    const bottom = height - 4;
    const peak = Math.max(500, prerollMs * 2, ...this.points.map((p) => p.bufferedMs));
    const scale = niceCeiling(peak);
    const x = (t) => ((t - (nowMs - this.windowMs)) / this.windowMs) * width;
    const y = (value) => bottom - (Math.min(value, scale) / scale) * (bottom - top);

    g.font = "11px Inter, system-ui, sans-serif";
    g.fillStyle = COLORS.muted;
    g.textBaseline = "top";
    g.textAlign = "right";
    g.fillText(`${scale} ms`, width - 2, 0);
    g.strokeStyle = COLORS.grid;
    g.beginPath();
    g.moveTo(0, bottom + 0.5);
    g.lineTo(width, bottom + 0.5);
    g.stroke();

    if (prerollMs) {
      g.strokeStyle = COLORS.buffer;
      g.setLineDash([4, 3]);
      g.beginPath();
      g.moveTo(0, Math.round(y(prerollMs)) + 0.5);
      g.lineTo(width, Math.round(y(prerollMs)) + 0.5);
      g.stroke();
      g.setLineDash([]);
      g.textAlign = "left";
      g.fillStyle = COLORS.buffer;
      g.fillText(`pre-roll ${prerollMs} ms`, 2, 0);
    }

    const visible = this.points.filter((p) => p.t >= nowMs - this.windowMs - 200);
    if (visible.length > 1) {
      const gradient = g.createLinearGradient(0, top, 0, bottom);
      gradient.addColorStop(0, "rgba(79, 70, 229, 0.35)");
      gradient.addColorStop(1, "rgba(14, 165, 233, 0.05)");
      g.beginPath();
      g.moveTo(x(visible[0].t), bottom);
      for (const p of visible) g.lineTo(x(p.t), y(p.bufferedMs));
      g.lineTo(x(visible[visible.length - 1].t), bottom);
      g.closePath();
      g.fillStyle = gradient;
      g.fill();
      g.beginPath();
      visible.forEach((p, i) => (i ? g.lineTo(x(p.t), y(p.bufferedMs)) : g.moveTo(x(p.t), y(p.bufferedMs))));
      g.strokeStyle = COLORS.play;
      g.lineWidth = 1.5;
      g.stroke();
      g.lineWidth = 1;
      for (let i = 1; i < visible.length; i++) {
        if (visible[i].underruns > visible[i - 1].underruns) {
          g.fillStyle = COLORS.cut;
          g.fillRect(x(visible[i].t) - 1, top, 2, bottom - top);
        }
      }
    }
  }
}

function niceCeiling(value) {
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * magnitude >= value) return step * magnitude;
  return 10 * magnitude;
}
