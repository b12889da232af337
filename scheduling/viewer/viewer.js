// gpubench step-log viewer: draws a replay directory's step log with plain canvas (no libraries,
// nothing fetched from outside: the page must work offline and from a single exported file).
(function () {
  'use strict';

  // State the tests read: window.gpubenchViewer.{ready, error, summary, charts[id].marks}.
  const viewer = { ready: false, error: null, summary: {}, charts: {} };
  window.gpubenchViewer = viewer;
  const PAD = { l: 56, r: 12, t: 20, b: 24 };

  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return '–';
    if (Number.isInteger(v) && digits === undefined) return Math.abs(v) >= 1e4 ? v.toLocaleString('en-US') : String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
    if (a >= 1e4) return Math.round(v).toLocaleString('en-US');
    const d = digits === undefined ? (a >= 100 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3) : digits;
    return v.toFixed(d);
  }

  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return ticks;
  }

  function quantile(sorted, q) {  // numpy's default (linear interpolation)
    if (!sorted.length) return NaN;
    const pos = (sorted.length - 1) * q, lo = Math.floor(pos), hi = Math.ceil(pos);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
  }
  const sum = a => a.reduce((s, v) => s + (v || 0), 0);
  const mean = a => (a.length ? sum(a) / a.length : NaN);

  function makeCanvas(id, height) {
    const el = document.getElementById(id);
    el.innerHTML = '';
    const c = document.createElement('canvas');
    el.appendChild(c);
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(200, el.clientWidth);
    const h = height || el.clientHeight || 200;
    c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    c.style.height = h + 'px';
    const ctx = c.getContext('2d');
    ctx.scale(dpr, dpr);
    ctx.font = '11px system-ui, sans-serif';
    return { el, c, ctx, w, h };
  }

  // Tick labels with as many decimals as the tick step needs (0, 2.5, 5 -> "0", "2.5", "5").
  function tickFmt(ticks) {
    const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 1;
    const d = Math.min(6, (String(+step.toPrecision(6)).split('.')[1] || '').length);
    return v => (Math.abs(v) >= 1e4 ? Math.round(v).toLocaleString('en-US') : v.toFixed(d));
  }

  function axes(g, x0, x1, y0, y1, opts) {
    const { ctx, w, h } = g;
    const pw = w - PAD.l - PAD.r, ph = h - PAD.t - PAD.b;
    const sx = v => PAD.l + (v - x0) / (x1 - x0 || 1) * pw;
    const sy = v => PAD.t + ph - (v - y0) / (y1 - y0 || 1) * ph;
    ctx.strokeStyle = cssVar('--grid'); ctx.fillStyle = cssVar('--muted'); ctx.lineWidth = 1;
    ctx.textAlign = 'right'; ctx.textBaseline = 'middle';
    const yt = niceTicks(y0, y1, 4), yf = tickFmt(yt);
    for (const t of yt) {
      const y = Math.round(sy(t)) + 0.5;
      ctx.beginPath(); ctx.moveTo(PAD.l, y); ctx.lineTo(w - PAD.r, y); ctx.stroke();
      ctx.fillText(opts && opts.yfmt ? opts.yfmt(t) : yf(t), PAD.l - 4, y);
    }
    ctx.textAlign = 'center'; ctx.textBaseline = 'top';
    const xt = niceTicks(x0, x1, Math.max(2, Math.floor(pw / 90))), xf = tickFmt(xt);
    for (const t of xt) {
      const x = sx(t);
      if (x < PAD.l - 1 || x > w - PAD.r + 1) continue;
      ctx.fillText(opts && opts.xfmt ? opts.xfmt(t) : xf(t), x, h - PAD.b + 4);
    }
    if (opts && opts.xlabel) { ctx.textAlign = 'right'; ctx.fillText(opts.xlabel, w - PAD.r, h - 12); }
    return { sx, sy, pw, ph };
  }

  function legend(g, items) {
    const { ctx } = g;
    let x = PAD.l;
    ctx.textAlign = 'left'; ctx.textBaseline = 'middle';
    for (const it of items) {
      ctx.fillStyle = it.color; ctx.fillRect(x, 5, 10, 8);
      ctx.fillStyle = cssVar('--ink'); ctx.fillText(it.name, x + 14, 9);
      x += 24 + ctx.measureText(it.name).width;
    }
  }

  // Per-pixel reduction: many steps share one pixel column; keep the column's max (peaks stay
  // visible) or mean (stacked areas keep their area).
  // Returns [px, value, pxEnd]: pxEnd is where the column's last step ends (steps last dur_s), so
  // idle time between steps stays visibly empty instead of being interpolated over.
  function perPixel(xs, ys, sx, how, ends) {
    const cols = new Map();
    for (let i = 0; i < xs.length; i++) {
      const px = Math.floor(sx(xs[i]));
      const y = ys[i] || 0;
      const e = ends ? sx(ends[i]) : px + 1;
      const c = cols.get(px);
      if (!c) cols.set(px, { n: 1, s: y, m: y, e });
      else { c.n++; c.s += y; c.m = Math.max(c.m, y); c.e = Math.max(c.e, e); }
    }
    const out = [];
    for (const [px, c] of [...cols.entries()].sort((a, b) => a[0] - b[0])) {
      out.push([px, how === 'mean' ? c.s / c.n : c.m, Math.max(px + 1, c.e)]);
    }
    return out;
  }

  function noDataNote(g, text) {
    const { ctx, w, h } = g;
    ctx.fillStyle = cssVar('--muted'); ctx.textAlign = 'center'; ctx.textBaseline = 'middle';
    ctx.font = '12px system-ui, sans-serif';
    ctx.fillText(text, w / 2, h / 2);
  }

  function tooltip(g, handler) {
    const tip = document.getElementById('tooltip');
    g.c.addEventListener('mousemove', ev => {
      const r = g.c.getBoundingClientRect();
      const text = handler(ev.clientX - r.left, ev.clientY - r.top);
      if (!text) { tip.hidden = true; return; }
      tip.textContent = text; tip.hidden = false;
      tip.style.left = Math.min(window.innerWidth - 240, ev.clientX + 12) + 'px';
      tip.style.top = (ev.clientY + 12) + 'px';
    });
    g.c.addEventListener('mouseleave', () => { tip.hidden = true; });
  }

  function nearestIndex(xs, x) {
    let lo = 0, hi = xs.length - 1;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (xs[mid] < x) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(xs[lo - 1] - x) < Math.abs(xs[lo] - x)) lo--;
    return lo;
  }

  // A time-series chart. series: [{name, y, color, kind: 'area'|'line', stack: bool, how}]
  function timeChart(id, xs, series, opts) {
    const g = makeCanvas(id);
    opts = opts || {};
    const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length - 1] : 1;
    const stacked = series.filter(s => s.stack);
    let ymax = opts.ymax || 0;
    if (!opts.ymax) {
      for (const s of series) if (!s.stack) for (const v of s.y) ymax = Math.max(ymax, v || 0);
      if (stacked.length) for (let i = 0; i < xs.length; i++) ymax = Math.max(ymax, sum(stacked.map(s => s.y[i])));
    }
    const A = axes(g, x0, x1, 0, ymax * 1.05 || 1, { xlabel: opts.xlabel || 'time (s)' });
    const { ctx } = g;
    // Tokens happen during a step (draw over its duration; idle time stays empty); a state such
    // as a block count holds until the next step changes it (draw up to the next step).
    const ends = opts.dur ? xs.map((x, i) => x + (opts.dur[i] || 0))
      : xs.map((x, i) => (i + 1 < xs.length ? xs[i + 1] : x1));
    let marks = 0;
    const seriesMarks = {};
    // stacked series: one column per pixel (mean over the steps in it) from the lower series' top
    let base = null;
    for (const s of stacked) {
      const pts = perPixel(xs, s.y, A.sx, 'mean', ends);
      ctx.fillStyle = s.color;
      pts.forEach(([px, v, pe], k) => {
        const b = base ? base[k][1] : 0;
        if (v > 0) ctx.fillRect(px, A.sy(b + v), pe - px, A.sy(b) - A.sy(b + v));
      });
      seriesMarks[s.name] = pts.filter(p => p[1] > 0).length;
      marks += seriesMarks[s.name];
      base = pts.map(([px, v, pe], k) => [px, v + (base ? base[k][1] : 0), pe]);
    }
    // the tallest stacked column drawn (tests check it against the token budget)
    const stackMax = base ? Math.max(0, ...base.map(p => p[1])) : null;
    // other series: step lines (a state such as a block count holds until the next step changes it)
    for (const s of series.filter(s => !s.stack)) {
      const pts = perPixel(xs, s.y, A.sx, s.how || 'max', null);
      ctx.beginPath();
      pts.forEach(([px, v], k) => {
        if (!k) { ctx.moveTo(px, A.sy(v)); return; }
        ctx.lineTo(px, A.sy(pts[k - 1][1])); ctx.lineTo(px, A.sy(v));
      });
      if (pts.length) ctx.lineTo(A.sx(x1), A.sy(pts[pts.length - 1][1]));
      ctx.strokeStyle = s.color; ctx.lineWidth = s.width || 1.5; ctx.setLineDash(s.dash || []);
      ctx.stroke(); ctx.setLineDash([]);
      seriesMarks[s.name] = pts.filter(p => p[1] > 0).length;
      marks += seriesMarks[s.name];
    }
    if (opts.empty) noDataNote(g, opts.empty);
    legend(g, series.map(s => ({ name: s.name, color: s.color })));
    viewer.charts[id] = { marks, seriesMarks, stackMax, ymax };
    tooltip(g, (mx) => {
      if (mx < PAD.l || !xs.length) return null;
      const t = x0 + (mx - PAD.l) / A.pw * (x1 - x0);
      const i = nearestIndex(xs, t);
      const lines = [`t = ${fmt(xs[i])} s` + (opts.extra ? opts.extra(i) : '')];
      for (const s of series) lines.push(`${s.name}: ${fmt(s.y[i])}`);
      return lines.join('\n');
    });
  }

  function barChart(id, labels, values) {
    const g = makeCanvas(id);
    const { ctx, w, h } = g;
    const total = sum(values) || 1;
    const rowH = Math.min(26, (h - 10) / Math.max(1, labels.length));
    const left = 110, maxV = Math.max(1, ...values);
    const label = i => `${values[i].toLocaleString('en-US')} (${(100 * values[i] / total).toFixed(1)} %)`;
    const labelW = Math.max(0, ...labels.map((_, i) => ctx.measureText(label(i)).width)) + 12;
    ctx.textBaseline = 'middle';
    labels.forEach((lab, i) => {
      const y = 5 + i * rowH;
      const bw = Math.max(0, w - left - labelW) * values[i] / maxV;
      ctx.fillStyle = cssVar('--prefill'); ctx.fillRect(left, y + 3, Math.max(1, bw), rowH - 6);
      ctx.fillStyle = cssVar('--ink'); ctx.textAlign = 'right'; ctx.fillText(lab, left - 6, y + rowH / 2);
      ctx.textAlign = 'left';
      ctx.fillText(label(i), left + bw + 6, y + rowH / 2);
    });
    viewer.charts[id] = { marks: labels.length };
  }

  function histogram(id, series, lo, hi, numBins, opts) {
    const g = makeCanvas(id);
    const { ctx } = g;
    const counts = series.map(s => {
      const c = new Array(numBins).fill(0);
      for (const v0 of s.values) {
        if (v0 === null || Number.isNaN(v0)) continue;
        const v = opts && opts.log ? Math.log10(Math.max(v0, 1e-6)) : v0;
        c[Math.min(numBins - 1, Math.max(0, Math.floor((v - lo) / (hi - lo) * numBins)))]++;
      }
      return c;
    });
    const ymax = Math.max(1, ...counts.flat());
    const A = axes(g, lo, hi, 0, ymax * 1.05, { xfmt: opts && opts.log ? (t => fmt(Math.pow(10, t))) : undefined });
    let marks = 0;
    const bw = A.pw / numBins / series.length;
    series.forEach((s, k) => {
      ctx.fillStyle = s.color;
      counts[k].forEach((c, i) => {
        if (!c) return;
        const x = A.sx(lo + (hi - lo) * i / numBins) + k * bw;
        ctx.fillRect(x + 0.5, A.sy(c), Math.max(1, bw - 1), A.sy(0) - A.sy(c));
        marks++;
      });
    });
    legend(g, series.map(s => ({ name: s.name, color: s.color })));
    viewer.charts[id] = { marks };
  }

  // [first arrival, last finish] of a run's timeline turns ([0, 1] when it has none).
  function timelineSpan(T) {
    let x0 = Infinity, x1 = -Infinity;
    for (let i = 0; i < T.job_id.length; i++) { x0 = Math.min(x0, T.arrival_s[i]); x1 = Math.max(x1, T.finish_s[i]); }
    return Number.isFinite(x0) ? [x0, x1] : [0, 1];
  }

  // Gantt of the first jobs: one row per job; per turn queue / prefill / decode bars; tool gaps as lines.
  // span: the time axis [x0, x1] (runs compared share one, so a job's bars line up across them).
  function jobTimeline(id, data, span) {
    const jobs = data.timeline_jobs, T = data.timeline_turns;
    const rowH = 10, h = PAD.t + PAD.b + Math.max(1, jobs.length) * rowH + 4;
    const g = makeCanvas(id, h);
    const { ctx } = g;
    const row = new Map(jobs.map((j, i) => [j, i]));
    const [x0, x1] = span || timelineSpan(T);
    const A = axes(g, x0, x1, 0, 0, { xlabel: 'time (s)', yfmt: () => '' });
    const sx = A.sx;
    ctx.clearRect(0, 0, PAD.l - 2, h - PAD.b);
    const col = { q: cssVar('--queue'), p: cssVar('--prefill'), d: cssVar('--decode'), g: cssVar('--gap'), x: cssVar('--preempt') };
    let marks = 0;
    const rects = [];
    let prev = null;
    for (let i = 0; i < T.job_id.length; i++) {
      const r = row.get(T.job_id[i]);
      const y = PAD.t + r * rowH;
      if (prev !== null && T.job_id[prev] === T.job_id[i]) {  // tool gap since the previous turn's finish
        ctx.strokeStyle = col.g; ctx.lineWidth = 1;
        ctx.beginPath(); ctx.moveTo(sx(T.finish_s[prev]), y + rowH / 2); ctx.lineTo(sx(T.arrival_s[i]), y + rowH / 2); ctx.stroke();
      }
      const segs = [[T.arrival_s[i], T.first_scheduled_s[i], col.q], [T.first_scheduled_s[i], T.first_token_s[i], col.p],
                    [T.first_token_s[i], T.finish_s[i], col.d]];
      for (const [a, b, c] of segs) {
        if (a === null || b === null) continue;
        ctx.fillStyle = c;
        ctx.fillRect(sx(a), y + 1, Math.max(1, sx(b) - sx(a)), rowH - 2);
      }
      if (T.num_preemptions[i] > 0) {
        ctx.strokeStyle = col.x; ctx.lineWidth = 1.5;
        ctx.strokeRect(sx(T.arrival_s[i]), y + 1, Math.max(2, sx(T.finish_s[i]) - sx(T.arrival_s[i])), rowH - 2);
      }
      rects.push([sx(T.arrival_s[i]), sx(T.finish_s[i]), r, i]);
      marks++;
      prev = i;
    }
    ctx.fillStyle = cssVar('--muted'); ctx.textAlign = 'right'; ctx.textBaseline = 'middle'; ctx.font = '9px system-ui, sans-serif';
    jobs.forEach((j, r) => {
      let label = String(j);
      while (label.length > 3 && ctx.measureText(label).width > PAD.l - 6) label = label.slice(1);
      if (label !== String(j)) label = '…' + label.slice(1);
      ctx.fillText(label, PAD.l - 4, PAD.t + r * rowH + rowH / 2);
    });
    viewer.charts[id] = { marks };
    tooltip(g, (mx, my) => {
      const r = Math.floor((my - PAD.t) / rowH);
      const hit = rects.find(([a, b, rr]) => rr === r && mx >= a - 2 && mx <= b + 2);
      if (!hit) return null;
      const i = hit[3];
      return `${T.job_id[i]} turn ${T.turn[i]}\narrival ${fmt(T.arrival_s[i])} s\nTTFT ${fmt(T.ttft_s[i])} s\n` +
             `prefix hit ${T.hit_tokens[i]} / ${T.prompt_tokens[i]} tokens\npreemptions ${T.num_preemptions[i]}`;
    });
  }

  // ---- summary recomputed from the tables, next to summary.json's own numbers ----
  function findMetric(summary, names) {
    const pools = [summary.metrics || {}, summary];
    for (const p of pools) for (const n of names) {
      const v = n.split('.').reduce((o, k) => (o && typeof o === 'object' ? o[k] : undefined), p);  // a.b: nested
      if (typeof v === 'number' || v === null) return v;
    }
    return undefined;
  }

  // Attainment of the replay's agent SLO (summary.json's slo_attainment.slo) per kind, per turn and
  // per job, and the goodputs, from the turn and job tables: a turn meets it when it meets TTFT,
  // TPOT and, if it triggers a tool, the tool-turn deadline; a job when all its turns do and, with
  // a job deadline, its JCT meets that.
  function sloAttainment(data, span) {
    const block = ((data.summary.metrics || {}).slo_attainment) || {};
    const slo = block.slo;
    if (!slo || !data.turn_latency_s) return {};
    const within = (v, target) => target === null || target === undefined || v === null || v <= target;
    const okTurn = {}, jobOk = {};
    let meet = 0, tokens = 0, ttftOk = 0, tpotOk = 0, tool = 0, toolOk = 0;
    data.turn_ttft_s.forEach((t, i) => {
      const a = within(t, slo.ttft_s), b = within(data.turn_tpot_s[i], slo.tpot_s);
      const hasTool = data.turn_has_tool[i], c = !hasTool || within(data.turn_latency_s[i], slo.tool_turn_s);
      ttftOk += a; tpotOk += b; tool += hasTool; toolOk += hasTool && c;
      const ok = a && b && c;
      meet += ok; tokens += ok ? data.turn_output_tokens[i] : 0;
      const job = data.turn_job_id[i];
      okTurn[job] = (okTurn[job] === undefined ? true : okTurn[job]) && ok;
    });
    let jobsMeet = 0;
    data.jobs.job_id.forEach((j, k) => {
      jobOk[j] = (okTurn[j] !== false) && within(data.jobs.jct_s[k], slo.job_s);
      jobsMeet += jobOk[j];
    });
    const n = data.turn_ttft_s.length, nj = data.jobs.job_id.length;
    return {
      slo_attainment_turn: n ? meet / n : null, slo_attainment_job: nj ? jobsMeet / nj : null,
      slo_attainment_ttft: n ? ttftOk / n : null, slo_attainment_tpot: n ? tpotOk / n : null,
      slo_attainment_tool_turn: tool ? toolOk / tool : null,
      job_goodput_per_s: jobsMeet / span, token_goodput_per_s: tokens / span,
    };
  }

  function computeSummary(data) {
    const jct = data.jobs.jct_s.filter(v => v !== null).slice().sort((a, b) => a - b);
    const ttft = data.turn_ttft_s.filter(v => v !== null).slice().sort((a, b) => a - b);
    const S = data.steps;
    const hit = sum(data.turn_hit_tokens), prompt = sum(data.turn_prompt_tokens), pool = sum(data.turn_pool_hit_tokens);
    const tpotAll = data.turn_tpot_s || [];
    const tpot = tpotAll.filter(v => v !== null).slice().sort((a, b) => a - b);
    // Goodput: output tokens of turns meeting the SLO (summary.json states it) per second of the
    // span from the first arrival to the last finish, as the replay's summary counts it.
    const slo = ((data.summary.metrics || {}).slo) || { ttft_s: 2.0, tpot_s: 0.1 };
    let good = 0, meet = 0;
    data.turn_ttft_s.forEach((t, i) => {
      const p = tpotAll[i];
      if (t !== null && t <= slo.ttft_s && (p === null || p === undefined || p <= slo.tpot_s)) {
        meet += 1; good += (data.turn_output_tokens || [])[i] || 0;
      }
    });
    const arrivals = data.jobs.arrival_s.filter(v => v !== null), finishes = data.jobs.finish_s.filter(v => v !== null);
    const span = Math.max(finishes.reduce((a, b) => Math.max(a, b), -Infinity) -
                          arrivals.reduce((a, b) => Math.min(a, b), Infinity), 1e-12);
    return {
      num_jobs: data.jobs.job_id.length,
      num_turns: data.turn_ttft_s.length,
      steps: data.steps_binned ? data.totals.num_steps : S.step.length,
      jct_mean_s: mean(jct), jct_p50_s: quantile(jct, 0.5), jct_p90_s: quantile(jct, 0.9), jct_p99_s: quantile(jct, 0.99),
      ttft_mean_s: mean(ttft), ttft_p50_s: quantile(ttft, 0.5), ttft_p90_s: quantile(ttft, 0.9),
      ttft_p99_s: quantile(ttft, 0.99),
      tpot_p50_s: tpot.length ? quantile(tpot, 0.5) : null, tpot_p90_s: tpot.length ? quantile(tpot, 0.9) : null,
      tpot_p99_s: tpot.length ? quantile(tpot, 0.99) : null,
      slo_turn_share: data.turn_ttft_s.length ? meet / data.turn_ttft_s.length : null,
      goodput_tok_per_s: data.turn_output_tokens ? good / span : null,
      preemptions: sum(S.num_preemptions),
      gpu_prefix_hit_rate: prompt ? hit / prompt : NaN,
      pool_hit_rate: prompt > hit ? pool / (prompt - hit) : null,  // share of GPU misses the pool served
      prefill_tokens: sum(S.num_prefill_tokens),
      decode_tokens: sum(S.num_decode_tokens),
      ...sloAttainment(data, span),
    };
  }
  // names under which summary.json may carry each figure
  const METRIC_NAMES = {
    num_jobs: ['num_jobs', 'jobs'], num_turns: ['num_turns', 'turns'], steps: ['steps', 'num_steps'],
    jct_mean_s: ['jct_mean_s', 'jct_s_mean', 'mean_jct_s'], jct_p50_s: ['jct_p50_s', 'jct_s_p50'],
    jct_p90_s: ['jct_p90_s', 'jct_s_p90'], jct_p99_s: ['jct_p99_s', 'jct_s_p99'],
    ttft_mean_s: ['ttft_mean_s', 'ttft_s_mean'], ttft_p50_s: ['ttft_p50_s', 'ttft_s_p50'], ttft_p90_s: ['ttft_p90_s', 'ttft_s_p90'],
    ttft_p99_s: ['ttft_p99_s'], tpot_p50_s: ['tpot_p50_s'], tpot_p90_s: ['tpot_p90_s'], tpot_p99_s: ['tpot_p99_s'],
    slo_turn_share: ['slo_turn_share'], goodput_tok_per_s: ['goodput_tok_per_s'],
    preemptions: ['preemptions', 'num_preemptions'],
    gpu_prefix_hit_rate: ['gpu_prefix_hit_rate', 'prefix_hit_rate', 'gpu_hit_rate'],
    pool_hit_rate: ['pool_hit_rate', 'offload_hit_rate', 'pool_prefix_hit_rate'],
    prefill_tokens: ['prefill_tokens', 'num_prefill_tokens', 'computed_tokens'], decode_tokens: ['decode_tokens', 'num_decode_tokens'],
    slo_attainment_turn: ['slo_attainment.turn'], slo_attainment_job: ['slo_attainment.job'],
    slo_attainment_ttft: ['slo_attainment.ttft'], slo_attainment_tpot: ['slo_attainment.tpot'],
    slo_attainment_tool_turn: ['slo_attainment.tool_turn'], job_goodput_per_s: ['slo_attainment.job_goodput_per_s'],
    token_goodput_per_s: ['slo_attainment.token_goodput_per_s'],
  };

  function renderSummary(data) {
    const js = computeSummary(data);
    const table = document.getElementById('js-summary');
    table.innerHTML = '';
    const mismatches = [];
    const keys = Object.keys(js);
    const perRow = 3;
    for (let r = 0; r < keys.length; r += perRow) {
      const tr = document.createElement('tr');
      for (const k of keys.slice(r, r + perRow)) {
        const ref = findMetric(data.summary, METRIC_NAMES[k] || [k]);
        const ok = ref === undefined || ref === null || js[k] === null ||
                   Math.abs(ref - js[k]) <= 1e-6 + 1e-4 * Math.abs(ref);
        if (!ok) mismatches.push(k);
        const isRate = k.endsWith('rate') || k.startsWith('slo_attainment');
        const show = v => (v === null ? '–' : isRate ? (100 * v).toFixed(1) + ' %' : fmt(v));
        tr.insertAdjacentHTML('beforeend',
          `<td class="k">${k}</td><td class="v${ok ? '' : ' bad'}" data-key="${k}" data-value="${js[k]}">${show(js[k])}</td>` +
          `<td class="ref">${ref === undefined ? '' : show(ref)}</td>`);
      }
      table.appendChild(tr);
    }
    viewer.summary = js;
    viewer.mismatches = mismatches;
    document.getElementById('binned-note').textContent = data.steps_binned
      ? `Step log of ${data.totals.num_steps.toLocaleString('en-US')} steps drawn in ${data.steps.step.length} bins (tokens summed, blocks maxed).`
      : '';
  }

  function render(data) {
    document.getElementById('run-name').textContent = '— ' + data.name;
    const cfg = data.summary.config || {};
    document.getElementById('run-config').textContent = Object.entries(cfg)
      .filter(([, v]) => v === null || typeof v !== 'object').map(([k, v]) => `${k}=${v}`).join('  ·  ');
    renderSummary(data);
    const S = data.steps, t = S.t_s;
    const C = n => cssVar(n);
    // Tokens per step: a bin of binned steps holds sums over steps_in_bin steps; draw their mean.
    const perStep = y => (S.steps_in_bin ? y.map((v, i) => v / S.steps_in_bin[i]) : y);
    timeChart('chart-batch', t, [
      { name: 'prefill tokens / step', y: perStep(S.num_prefill_tokens), color: C('--prefill'), stack: true },
      { name: 'decode tokens / step', y: perStep(S.num_decode_tokens), color: C('--decode'), stack: true },
    ], { dur: S.dur_s, extra: i => `  (${S.break_reason[i]})` });
    // Per engine step (x = step number, so the many short decode steps get their share of the width):
    // decode at the bottom and prefill above it, each step's own tokens (a bin of a long log drawn as
    // its mean per step), under the token budget; decode alone again on its own scale below, since
    // a few dozen decode tokens are a sliver of an 8,192-token budget.
    const stepSpan = S.steps_in_bin || S.step.map(() => 1);
    const budget = data.token_budget;
    const stepSeries = [
      { name: 'decode tokens', y: perStep(S.num_decode_tokens), color: C('--decode'), stack: true },
      { name: 'prefill tokens', y: perStep(S.num_prefill_tokens), color: C('--prefill'), stack: true },
    ];
    if (budget) stepSeries.push({ name: `token budget (${budget.toLocaleString('en-US')})`, y: S.step.map(() => budget),
                                  color: C('--total'), dash: [4, 3], width: 1 });
    timeChart('chart-step-tokens', S.step, stepSeries, { dur: stepSpan, xlabel: 'engine step',
      extra: i => `  step ${S.step[i]}${S.steps_in_bin ? ` (+${S.steps_in_bin[i] - 1} more, mean shown)` : ''}` });
    timeChart('chart-step-decode', S.step, [
      { name: 'decode tokens per step', y: perStep(S.num_decode_tokens), color: C('--decode'), stack: true },
    ], { dur: stepSpan, xlabel: 'engine step' });
    timeChart('chart-queue', t, [
      { name: 'running', y: S.num_running, color: C('--prefill') },
      { name: 'waiting', y: S.num_waiting, color: C('--preempt') },
    ]);
    timeChart('chart-kv', t, [
      { name: 'used', y: S.kv_used_blocks, color: C('--used'), stack: true },
      { name: 'pinned', y: S.kv_pinned_blocks, color: C('--pinned') },
      { name: 'cached (free, reusable)', y: S.kv_cached_blocks, color: C('--cached') },
      { name: 'total', y: S.kv_total_blocks, color: C('--total'), dash: [4, 3], width: 1 },
    ]);
    const poolSize = Math.max(0, ...S.pool_total_blocks);
    timeChart('chart-pool', t, [
      { name: 'pool used blocks', y: S.pool_used_blocks, color: C('--pool'), stack: true },
      { name: 'pool total', y: S.pool_total_blocks, color: C('--total'), dash: [4, 3], width: 1 },
      { name: 'tokens loaded from pool', y: S.num_pool_load_tokens, color: C('--pinned') },
    ], poolSize ? {} : { ymax: 1, empty: 'no offload / LMCache pool in this run' });
    const reasons = Object.entries(data.break_reasons).sort((a, b) => b[1] - a[1]);
    barChart('chart-break', reasons.map(r => r[0]), reasons.map(r => r[1]));
    let acc = 0;
    const cum = S.num_preemptions.map(v => (acc += v || 0));
    timeChart('chart-preempt', t, [{ name: 'preemptions (cumulative)', y: cum, color: C('--preempt') }]);
    const hitSeries = [{ name: 'GPU prefix hit', values: data.turn_hit_frac, color: C('--cached') }];
    if (data.turn_pool_frac.some(v => v > 0)) hitSeries.push({ name: 'pool hit', values: data.turn_pool_frac, color: C('--pool') });
    histogram('chart-hit', hitSeries, 0, 1, 20);
    const tt = data.turn_ttft_s.filter(v => v !== null && v > 0).map(v => Math.log10(v));
    const lo = tt.length ? Math.floor(Math.min(...tt)) : -3, hi = tt.length ? Math.ceil(Math.max(...tt)) : 1;
    histogram('chart-ttft', [{ name: 'turns', values: data.turn_ttft_s, color: C('--prefill') }], lo, Math.max(hi, lo + 1), 30, { log: true });
    document.getElementById('timeline-note').textContent =
      `(first ${data.timeline_jobs.length} of ${data.jobs.job_id.length} jobs by arrival)`;
    jobTimeline('chart-jobs', data);
  }

  // ---- several runs side by side: one summary table, curves overlaid, one colour per run ----
  // A run's label is its directory name: any character may appear in it, so it is escaped in HTML.
  const esc = t => String(t).replace(/[&<>"]/g, c => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' }[c]));
  // The timeline's colour key, as index.html writes it (read before a comparison replaces the page).
  const TIMELINE_LEGEND = (document.querySelector('.legend-row') || { outerHTML: '' }).outerHTML;
  const RUN_COLORS = ['#3b6fd8', '#f0a030', '#2fa37a', '#d43c3c', '#8e44ad', '#d97a2b', '#1d2430', '#8a9099'];

  // Step lines of series that each have their own x values (runs do not share step times).
  function overlayChart(id, series, opts) {
    const g = makeCanvas(id);
    opts = opts || {};
    let x0 = Infinity, x1 = -Infinity, ymax = 0;
    for (const s of series) {
      if (s.xs.length) { x0 = Math.min(x0, s.xs[0]); x1 = Math.max(x1, s.xs[s.xs.length - 1]); }
      for (const v of s.ys) ymax = Math.max(ymax, v || 0);
    }
    if (!Number.isFinite(x0)) { x0 = 0; x1 = 1; }
    const A = axes(g, x0, x1, 0, (opts.ymax || ymax * 1.05) || 1, { xlabel: opts.xlabel || 'time (s)', xfmt: opts.xfmt });
    const { ctx } = g;
    const seriesMarks = {};
    let marks = 0;
    for (const s of series) {
      const pts = perPixel(s.xs, s.ys, A.sx, 'max', null);
      ctx.beginPath();
      pts.forEach(([px, v], k) => {
        if (!k) { ctx.moveTo(px, A.sy(v)); return; }
        ctx.lineTo(px, A.sy(pts[k - 1][1])); ctx.lineTo(px, A.sy(v));
      });
      ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.stroke();
      seriesMarks[s.name] = pts.filter(p => p[1] > 0).length;
      marks += seriesMarks[s.name];
    }
    legend(g, series.map(s => ({ name: s.name, color: s.color })));
    viewer.charts[id] = { marks, seriesMarks, ymax };
  }

  function cdf(values, transform) {
    const v = values.filter(x => x !== null && !Number.isNaN(x)).map(transform || (x => x)).sort((a, b) => a - b);
    return { xs: v, ys: v.map((_, i) => (i + 1) / v.length) };
  }

  function renderCompare(data) {
    const runs = data.runs;
    document.title = 'gpubench: ' + runs.map(r => r.label).join(' vs ');
    document.getElementById('run-name').textContent = `— ${runs.length} runs side by side`;
    document.getElementById('run-config').textContent = runs.map(r => {
      const c = r.summary.config || {};
      return `${r.label}: ${[c.policy, c.sku, c.model].filter(v => v).join(' · ')}`;
    }).join('   |   ');
    const color = i => RUN_COLORS[i % RUN_COLORS.length];
    const card = (id, title, extra) =>
      `<section class="card${extra === 'wide' ? ' wide' : ''}"><h2>${title}</h2><div class="chart${extra === 'wide' ? '' : ' small-chart'}" id="${id}"></div></section>`;
    document.querySelector('main').innerHTML =
      `<section class="card wide"><h2>Summary <span class="muted small">(recomputed here from each run's CSVs; ` +
      `a value that disagrees with its summary.json is red)</span></h2><table id="compare-summary"></table></section>` +
      card('cmp-tokens', 'Tokens per step (prefill + decode; a bin drawn as its mean per step)', 'wide') +
      card('cmp-running', 'Running requests', 'wide') +
      card('cmp-kv', 'GPU KV blocks used', 'wide') +
      card('cmp-preempt', 'Preemptions (cumulative)') +
      card('cmp-ttft', 'TTFT per turn: CDF (log s)') +
      card('cmp-jct', 'JCT per job: CDF (s)') +
      card('cmp-hit', 'Prefix hit per turn: CDF (share of prompt)') +
      runs.map((r, i) => `<section class="card wide" data-run="${esc(r.label)}"><h2>Per-job timelines: ` +
        `<span style="color:${color(i)}">${esc(r.label)}</span> <span class="muted small">(first ` +
        `${r.timeline_jobs.length} of ${r.jobs.job_id.length} jobs by arrival; one time axis for every run)</span></h2>` +
        `${TIMELINE_LEGEND}<div class="chart timeline" id="cmp-jobs-${i}"></div></section>`).join('');
    // the summary table: a row per metric, a column per run
    const table = document.getElementById('compare-summary');
    const computed = runs.map(computeSummary);
    const keys = Object.keys(computed[0]);
    const mismatches = [];
    table.insertAdjacentHTML('beforeend', '<tr><td class="k">metric</td>' +
      runs.map((r, i) => `<td class="v run" style="color:${color(i)}">${esc(r.label)}</td>`).join('') + '</tr>');
    for (const k of keys) {
      const cells = runs.map((r, i) => {
        const js = computed[i][k], ref = findMetric(r.summary, METRIC_NAMES[k] || [k]);
        const ok = ref === undefined || ref === null || js === null || Math.abs(ref - js) <= 1e-6 + 1e-4 * Math.abs(ref);
        if (!ok) mismatches.push(`${r.label}:${k}`);
        const show = js === null ? '–' : (k.endsWith('rate') || k.startsWith('slo_attainment')) ? (100 * js).toFixed(1) + ' %' : fmt(js);
        return `<td class="v${ok ? '' : ' bad'}" data-run="${esc(r.label)}" data-key="${k}" data-value="${js}">${show}</td>`;
      });
      table.insertAdjacentHTML('beforeend', `<tr><td class="k">${k}</td>${cells.join('')}</tr>`);
    }
    viewer.summary = Object.fromEntries(runs.map((r, i) => [r.label, computed[i]]));
    viewer.mismatches = mismatches;
    const perStep = (S, y) => (S.steps_in_bin ? y.map((v, i) => v / S.steps_in_bin[i]) : y);
    const over = (id, ys, opts) => overlayChart(id, runs.map((r, i) => ({ name: r.label, xs: r.steps.t_s, ys: ys(r.steps), color: color(i) })), opts);
    over('cmp-tokens', S => perStep(S, S.num_prefill_tokens.map((v, i) => v + S.num_decode_tokens[i])));
    over('cmp-running', S => S.num_running);
    over('cmp-kv', S => S.kv_used_blocks);
    over('cmp-preempt', S => { let acc = 0; return S.num_preemptions.map(v => (acc += v || 0)); });
    const cdfChart = (id, values, transform, opts) => overlayChart(id, runs.map((r, i) => {
      const c = cdf(values(r), transform);
      return { name: r.label, xs: c.xs, ys: c.ys, color: color(i) };
    }), { ymax: 1, ...opts });
    cdfChart('cmp-ttft', r => r.turn_ttft_s.filter(v => v !== null && v > 0), Math.log10,
             { xlabel: 'TTFT (s)', xfmt: t => fmt(Math.pow(10, t)) });
    cdfChart('cmp-jct', r => r.jobs.jct_s, null, { xlabel: 'JCT (s)' });
    cdfChart('cmp-hit', r => r.turn_hit_frac, null, { xlabel: 'share of prompt' });
    const spans = runs.map(r => timelineSpan(r.timeline_turns));
    const span = [Math.min(...spans.map(s => s[0])), Math.max(...spans.map(s => s[1]))];
    runs.forEach((r, i) => jobTimeline(`cmp-jobs-${i}`, r, span));
  }

  async function getData() {
    const txt = document.getElementById('gpubench-data').textContent.trim();
    if (txt && !txt.startsWith('/*')) return JSON.parse(txt);  // exported page: data embedded
    const r = await fetch('data.json');
    if (!r.ok) throw new Error(`data.json: HTTP ${r.status}`);
    return r.json();
  }

  async function main() {
    try {
      const data = await getData();
      viewer.data = data;
      const draw = data.runs ? renderCompare : render;
      draw(data);
      let timer = null;
      window.addEventListener('resize', () => { clearTimeout(timer); timer = setTimeout(() => draw(data), 150); });
      viewer.ready = true;
    } catch (err) {
      viewer.error = String(err && err.stack || err);
      document.querySelector('main').innerHTML = `<div class="error">Cannot draw this run: ${String(err)}</div>`;
      console.error(err);
    }
  }
  main();
})();
