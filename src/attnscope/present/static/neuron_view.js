/* attnscope views: the neuron view (after Jesse Vig's BertViz neuron view).
 *
 * For one layer, head and query token: the query vector q, each key vector k, their elementwise
 * product q*k, the dot product q.k and softmax(q.k * scaling) over the keys the query may see
 * (all keys, or keys up to the query in causal attention), beside the recorded attention.
 * Vectors are colour strips, blue positive and orange negative, opacity = |value| / the largest
 * |value| of the strips of the same kind. Only this one (layer, head, query) is computed, here,
 * on demand, from the shipped q and k (see payload.py for why). With grouped key/value heads the
 * key head shared by the query head is named.
 */
(function (NS) {
  "use strict";

  const BAR = 70;

  class NeuronView {
    constructor(app, container) {
      this.app = app;
      this.scene = null;
      const controls = NS.element("div", "as-controls");
      const [headLabel, head] = NS.control("select", "Head", "neuron-head");
      const [queryLabel, query] = NS.control("select", "Query token", "neuron-query");
      this.head = head;
      this.query = query;
      controls.append(headLabel, queryLabel);
      const wrap = NS.element("div", "as-canvas-wrap");
      this.surface = new NS.Surface(wrap, "neuron-canvas");
      this.canvas = this.surface.canvas;
      container.append(controls, wrap);
      this.head.addEventListener("change", () => { app.state.neuronHead = Number(this.head.value); this.render(); });
      this.query.addEventListener("change", () => app.selectToken(Number(this.query.value)));
    }

    sync() {
      const app = this.app;
      const kind = app.kind();
      const tokens = app.payload.sides[kind.query_side].tokens;
      app.state.neuronHead = Math.min(app.state.neuronHead, app.nHeads() - 1);
      app.state.query = Math.min(app.state.query, tokens.length - 1);
      this.head.replaceChildren(...Array.from({ length: app.nHeads() }, (_, h) => new Option(`${h}`, String(h))));
      this.query.replaceChildren(...tokens.map((token, pos) => new Option(`${pos}: ${NS.label(token, 30)}`, String(pos))));
      this.head.value = String(app.state.neuronHead);
      this.query.value = String(app.state.query);
    }

    render() {
      const app = this.app;
      const kind = app.kind();
      const vectors = app.vectors();
      this.head.value = String(app.state.neuronHead);
      this.query.value = String(app.state.query);
      if (!vectors) return this.say(`No queries/keys for ${kind.label}: extract with qkv=True to see the neuron view.`);
      if (app.layerLevel()) {
        // its numbers are per layer, not per head: beside one head's q.k they would read as that head's
        const entry = app.mixingEntry();
        return this.say(`The neuron view compares one head's q\u00b7k with its recorded row; ${entry ? entry.label : app.state.measure} ` +
          "is one map per layer (no heads), so it is not shown here: choose attention \u03b1 or \u2016\u03b1f(x)\u2016 in Measure.");
      }
      const numbers = this.compute(vectors);
      this.scene = this.draw(numbers);
      this.surface.show(this.scene);
    }

    /* A one-line scene instead of the figure (role "message", for tests). */
    say(text) {
      const scene = new NS.Scene(Math.max(640, NS.textWidth(text, 13) + 16), 40);
      scene.text(8, 20, text, { size: 13 }, { role: "message" });
      this.scene = scene;
      this.surface.show(scene);
    }

    /* q, every visible k, q*k, q.k, softmax(q.k * scaling), and the recorded row, for the current choice. */
    compute(vectors) {
      const app = this.app;
      const kind = app.kind();
      const { layer, neuronHead: head, query } = app.state;
      const heads = app.nHeads();
      const group = heads / vectors.nKvHeads;
      const kvHead = Math.floor(head / group);
      const q = vectors.queries.vector(layer, head, query);
      const nKeys = vectors.keys.shape[2];
      const visible = kind.causal ? Math.min(query + 1, nKeys) : nKeys;
      const keys = [];
      for (let pos = 0; pos < visible; pos++) {
        const k = vectors.keys.vector(layer, kvHead, pos);
        const product = new Float64Array(q.length);
        let dot = 0;
        for (let i = 0; i < q.length; i++) { product[i] = q[i] * k[i]; dot += product[i]; }
        keys.push({ pos, k, product, dot });
      }
      const scaling = app.payload.model.scaling;
      const top = Math.max(...keys.map((row) => row.dot * scaling));
      const exps = keys.map((row) => Math.exp(row.dot * scaling - top));
      const total = exps.reduce((a, b) => a + b, 0);
      keys.forEach((row, i) => { row.softmax = exps[i] / total; });
      const grid = app.grid();
      const recorded = grid.row(layer, head, query);
      keys.forEach((row) => { row.recorded = grid.value(layer, recorded[row.pos]); });
      return { layer, head, kvHead, group, query, q, keys, scaling };
    }

    draw(n) {
      const app = this.app;
      const kind = app.kind();
      const keyTokens = app.payload.sides[kind.key_side].tokens;
      const queryToken = app.payload.sides[kind.query_side].tokens[n.query];
      const d = n.q.length;
      const cell = Math.max(2, Math.min(10, Math.floor(256 / d)));
      const strip = d * cell;
      const rowHeight = n.keys.length > 100 ? 13 : 17;
      const size = rowHeight > 13 ? 12 : 10;
      const labelWidth = Math.min(150, Math.max(60, ...n.keys.map((row) => NS.textWidth(NS.label(keyTokens[row.pos], 22), size))));
      const x = { label: 8 + labelWidth, key: 16 + labelWidth };
      x.product = x.key + Math.max(strip, 20) + 24;
      x.dot = x.product + Math.max(strip, 130) + 24;
      x.softmax = x.dot + BAR + 70;
      x.recorded = x.softmax + BAR + 60;
      const width = x.recorded + BAR + 60;
      const top = 96;
      const scene = new NS.Scene(width, top + n.keys.length * rowHeight + 10);
      const sharing = n.group > 1
        ? ` \u00b7 key head ${n.kvHead} (shared by query heads ${n.kvHead * n.group}\u2013${(n.kvHead + 1) * n.group - 1})`
        : "";
      scene.text(8, 10, `${kind.label} \u00b7 layer ${app.layerName(n.layer)}, head ${n.head} (0-indexed)${sharing}`, { size: 12, weight: "bold" });
      scene.text(8, 28, `query: "${NS.label(queryToken, 40)}" (position ${n.query})${kind.causal ? " \u00b7 causal: later keys are masked" : ""}`,
        { size: 12 });

      NS.signedScale(scene, x.product, 50);
      const vectorPeak = Math.max(maxAbs(n.q), ...n.keys.map((row) => maxAbs(row.k)));
      const productPeak = Math.max(...n.keys.map((row) => maxAbs(row.product)));
      const dotPeak = Math.max(...n.keys.map((row) => Math.abs(row.dot)));
      scene.text(x.label, 50, "query q", { size, align: "right", color: "#555" });
      this.strip(scene, n.q, vectorPeak, x.key, 50 - rowHeight / 2 + 2, cell, rowHeight - 4);

      const header = top - 16;
      const recordedName = app.field() === "norms" ? "\u2016\u03b1f(x)\u2016 (recorded)" : "attention \u03b1 (recorded)";
      scene.text(x.label, header, "key k", { size, align: "right", color: "#555" });
      scene.text(x.key, header, "k", { size, color: "#555" });
      scene.text(x.product, header, "q \u00d7 k (elementwise)", { size, color: "#555" });
      scene.text(x.dot, header, "q \u00b7 k", { size, color: "#555" });
      scene.text(x.softmax, header, `softmax(q\u00b7k \u00d7 ${n.scaling.toPrecision(4)})`, { size, color: "#555" });
      scene.text(x.recorded, header, recordedName, { size, color: "#555" });
      const color = NS.headColor(n.head);
      const recordedRow = this.recordedRow(n);
      n.keys.forEach((row, i) => {
        const y = top + i * rowHeight;
        const middle = y + rowHeight / 2;
        scene.text(x.label, middle, NS.label(keyTokens[row.pos], 22), { size, align: "right" }, { role: "key", k_pos: row.pos });
        this.strip(scene, row.k, vectorPeak, x.key, y + 2, cell, rowHeight - 4);
        this.strip(scene, row.product, productPeak, x.product, y + 2, cell, rowHeight - 4);
        const dotColor = NS.signedColor(row.dot, dotPeak);
        scene.rect(x.dot, y + 3, (BAR * Math.abs(row.dot)) / (dotPeak || 1), rowHeight - 6, { fill: dotColor.fill, alpha: 0.8 });
        scene.text(x.dot + BAR + 4, middle, row.dot.toFixed(3), { size }, { role: "qk", k_pos: row.pos });
        scene.rect(x.softmax, y + 3, BAR * row.softmax, rowHeight - 6, { fill: color });
        scene.text(x.softmax + BAR + 4, middle, row.softmax.toFixed(4), { size }, { role: "softmax", k_pos: row.pos });
        const shown = recordedRow[i];
        scene.rect(x.recorded, y + 3, BAR * shown.fraction, rowHeight - 6, { fill: color, alpha: 0.6 });
        scene.text(x.recorded + BAR + 4, middle, app.formatWeight(shown.value), { size }, { role: "recorded", k_pos: row.pos });
      });
      return scene;
    }

    /* The recorded attention (or norm, with the norm toggle) of each visible key, with its bar length. */
    recordedRow(n) {
      const grid = this.app.grid();
      const bytes = grid.row(n.layer, n.head, n.query);
      return n.keys.map((row) => ({ value: grid.value(n.layer, bytes[row.pos]), fraction: bytes[row.pos] / 255 }));
    }

    strip(scene, values, peak, x, y, cell, height) {
      for (let i = 0; i < values.length; i++) {
        const { fill, alpha } = NS.signedColor(values[i], peak);
        if (alpha >= 0.02) scene.rect(x + i * cell, y, Math.max(1, cell - (cell > 3 ? 1 : 0)), height, { fill, alpha });
      }
      scene.rect(x - 0.5, y - 0.5, values.length * cell + 1, height + 1, { stroke: "#ddd", lineWidth: 1 });
    }

    /* For tests and tools: the numbers written on screen, one row per visible key. */
    displayed() {
      const rows = new Map();
      for (const item of this.scene ? this.scene.ofType("text") : []) {
        if (!item.meta || item.meta.k_pos === undefined) continue;
        const row = rows.get(item.meta.k_pos) || { k_pos: item.meta.k_pos };
        row[item.meta.role] = item.meta.role === "key" ? item.text : Number(item.text);
        rows.set(item.meta.k_pos, row);
      }
      return [...rows.values()];
    }
  }

  function maxAbs(values) {
    let peak = 0;
    for (const v of values) peak = Math.max(peak, Math.abs(v));
    return peak;
  }

  NS.NeuronView = NeuronView;
})((window.AttnscopeViews = window.AttnscopeViews || {}));
