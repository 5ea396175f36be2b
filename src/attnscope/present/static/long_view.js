/* attnscope views: the long-input view (payload format "attnscope.longview", longview.schema.json).
 *
 * Three panels over one state (layer, head or the mean of the layer's heads, window of tokens):
 *  - heatmap: queries down, keys across. Zoomed out it draws the block-averaged overview; once a
 *    canvas pixel holds at most one token it draws the top-k weights of each query (other keys
 *    blank). Under LABEL_SPAN tokens the axes carry token labels. Wheel or buttons zoom, drag pans,
 *    a click picks the window of the window head view, hovering writes query, key and weight.
 *  - model: layers x heads thumbnails (the overview grouped further in Python); click one to open
 *    it in the heatmap.
 *  - window: the line-based head view (head_view.js) of <= 128 tokens, from the top-k rows.
 * Every array is packed per (layer, head) and decoded only when a panel needs it.
 * When the first panel has drawn: performance mark "attnscope:<root id>:drawn", root.dataset.drawn.
 */
(function (NS) {
  "use strict";

  const PLOT = 640; // heatmap side in CSS px
  const LEFT = 120; // room for query labels
  const TOP = 112; // room for the caption, the legend and the (turned) key labels
  const LABEL_SPAN = 80; // token labels on the axes when fewer tokens than this are in sight
  const MIN_SPAN = 8; // deepest zoom: 8 tokens across
  const THUMB = 40; // thumbnail side in CSS px
  const THUMB_GAP = 6;
  const MASKED = [217, 217, 217, 255]; // causal attention: keys after the query
  const OUTSIDE = "#f4f4f4";
  const VIEW_NAMES = { heatmap: "Heatmap", model: "Model view", window: "Window head view" };
  // colour ramp (light yellow -> teal -> dark blue) for log10(weight per token pair)
  const STOPS = [[255, 255, 204], [161, 218, 180], [65, 182, 196], [34, 94, 168], [8, 29, 88]];

  const el = NS.element;

  function rampTable() {
    const table = new Uint8ClampedArray(256 * 4);
    for (let i = 0; i < 256; i++) {
      const t = (i / 255) * (STOPS.length - 1);
      const lo = Math.min(STOPS.length - 2, Math.floor(t));
      const f = t - lo;
      for (let c = 0; c < 3; c++) table[i * 4 + c] = STOPS[lo][c] * (1 - f) + STOPS[lo + 1][c] * f;
      table[i * 4 + 3] = 255;
    }
    return table;
  }
  const RAMP = rampTable();

  /* Colour scale: log10 of a weight per token pair, from `floor` (0.1 / tokens) to 1. */
  class Scale {
    constructor(tokens) {
      this.floor = 0.1 / tokens;
      this.decades = -Math.log10(this.floor);
    }
    /* Write the colour of `value` (> 0; 0 or less stays as it is: blank) at pixels[at]. */
    paint(pixels, at, value) {
      if (!(value > 0)) return;
      const t = Math.max(0, Math.min(1, 1 + Math.log10(value) / this.decades));
      const i = Math.round(t * 255) * 4;
      pixels[at] = RAMP[i]; pixels[at + 1] = RAMP[i + 1]; pixels[at + 2] = RAMP[i + 2]; pixels[at + 3] = 255;
    }
  }

  function blank(width, height) {
    const data = new Uint8ClampedArray(width * height * 4).fill(255);
    return { width, height, data };
  }

  // ---- the app: state, decoding, panels ------------------------------------------------------
  class LongApp {
    constructor(root, payload) {
      this.root = root;
      this.payload = payload;
      this.tokens = payload.tokens.length;
      this.scale = new Scale(this.tokens);
      this.decoded = new Map(); // name -> Promise of a decoded array
      this.drawCount = 0;
      const width = payload.window.width;
      this.state = { view: "heatmap", layer: 0, head: 0, window: { start: 0, width } }; // layer, head: indices
      this.fromAddress();
      this.build();
      if (this.state.head !== 0 && this.views.window) this.views.window.showHeads(this.state.head);
    }

    /* A page of its own starts where its address says: long.html#view=model&layer=5&head=2 (0-indexed layer and
       head numbers as the model counts them, head=mean for the layer's mean); what the page does not hold is ignored. */
    fromAddress() {
      const asked = new URLSearchParams(window.location.hash.replace(/^#/, ""));
      const layer = this.payload.layers.indexOf(Number(asked.get("layer")));
      if (asked.has("layer") && layer >= 0) this.state.layer = layer;
      const head = asked.get("head") === "mean" ? "mean" : this.payload.heads.indexOf(Number(asked.get("head")));
      if (asked.has("head") && head !== -1) this.state.head = head;
      if (this.payload.views.includes(asked.get("view"))) this.state.view = asked.get("view");
    }

    layerName() { return this.payload.layers[this.state.layer]; }
    headName(head) { return head === "mean" ? "mean" : this.payload.heads[head]; }
    headLabel() {
      return this.state.head === "mean" ? `mean of the ${this.payload.heads.length} heads` : `head ${this.headName(this.state.head)}`;
    }

    /* Decode once: `name` keys the cache, `make` returns the Promise. */
    once(name, make) {
      if (!this.decoded.has(name)) this.decoded.set(name, make());
      return this.decoded.get(name);
    }
    /* Overview [R, R] of (layer, head index | "mean") as Float32Array. */
    overview(layer, head) {
      const o = this.payload.overview;
      return this.once(`overview:${layer}:${head}`, () => NS.unpackNumbers(head === "mean" ? o.mean[layer] : o.heads[layer][head]));
    }
    /* Top-k rows of (layer, head index): {keys: Int32Array [k, q_pos], weights: Float32Array [k, q_pos], k}. */
    rows(layer, head) {
      return this.once(`rows:${layer}:${head}`, async () => {
        const top = this.payload.top_k;
        const [steps, weights] = await Promise.all([NS.unpackNumbers(top.indices[layer][head]), NS.unpackNumbers(top.weights[layer][head])]);
        const n = this.tokens;
        const keys = new Int32Array(steps.length);
        for (let r = 0; r < top.k; r++) { // positions were shipped as differences along q_pos (mod 65536)
          let position = 0;
          for (let q = 0; q < n; q++) { position = (position + steps[r * n + q]) & 0xffff; keys[r * n + q] = position; }
        }
        return { keys, weights, k: top.k };
      });
    }
    /* Rows of every head of the chosen head (one) or of the layer (the mean). */
    headRows(layer, head) {
      const heads = head === "mean" ? this.payload.heads.map((_, h) => h) : [head];
      return Promise.all(heads.map((h) => this.rows(layer, h)));
    }
    thumbnails() { return this.once("thumbnails", () => NS.unpackNumbers(this.payload.thumbnails.data)); }

    build() {
      const p = this.payload;
      const header = el("div", "as-header");
      header.append(el("div", "as-title", p.title));
      header.append(el("div", "as-subtitle", `${this.tokens.toLocaleString("en")} tokens \u00b7 ${p.causal ? "causal" : "bidirectional"} attention \u00b7 ` +
        `layers ${compactList(p.layers)} \u00b7 heads ${compactList(p.heads)} (0-indexed)`));
      for (const note of p.notes) header.append(el("div", "as-note", note));
      const bar = el("div", "as-toolbar");
      this.tabs = NS.tabs(p.views.map((name) => [name, VIEW_NAMES[name]]), (name) => this.setView(name));
      const [layerLabel, layerSelect] = NS.control("select", "Layer", "layer");
      p.layers.forEach((layer, i) => layerSelect.append(new Option(String(layer), String(i))));
      layerSelect.addEventListener("change", () => this.setLayer(Number(layerSelect.value)));
      const [headLabel, headSelect] = NS.control("select", "Head", "head");
      p.heads.forEach((head, i) => headSelect.append(new Option(String(head), String(i))));
      headSelect.append(new Option("mean of heads", "mean"));
      headSelect.addEventListener("change", () => this.setHead(headSelect.value === "mean" ? "mean" : Number(headSelect.value)));
      this.layerSelect = layerSelect;
      this.headSelect = headSelect;
      bar.append(this.tabs, layerLabel, headLabel);
      this.status = el("div", "as-status", "decoding\u2026");
      this.panels = {};
      this.views = {};
      const body = el("div", "as-body");
      const classes = { heatmap: Heatmap, model: Thumbnails, window: WindowView };
      for (const name of p.views) {
        const panel = el("div", "as-panel");
        panel.dataset.view = name;
        this.panels[name] = panel;
        this.views[name] = new classes[name](this, panel);
        body.append(panel);
      }
      this.root.classList.add("attnscope-root");
      this.root.replaceChildren(header, bar, this.status, body);
      this.syncControls();
    }

    syncControls() {
      this.layerSelect.value = String(this.state.layer);
      this.headSelect.value = String(this.state.head);
      for (const tab of this.tabs.children) tab.classList.toggle("as-active", tab.dataset.view === this.state.view);
      for (const [name, panel] of Object.entries(this.panels)) panel.hidden = name !== this.state.view;
    }

    /* Draw the current panel once what it needs is decoded; a newer request wins (app.js). */
    draw() {
      const view = this.views[this.state.view];
      return NS.drawLatest(this, () => view.prepare(), (data) => view.render(data));
    }

    setView(name) { this.state.view = name; this.syncControls(); return this.draw(); }
    setLayer(layer) { this.state.layer = layer; this.syncControls(); return this.draw(); }
    setHead(head) {
      this.state.head = head;
      this.views.window.showHeads(head);
      this.syncControls();
      return this.draw();
    }
    /* From the model view: that layer and head, in the heatmap. */
    openHead(layer, head) {
      this.state.layer = layer;
      this.views.window.showHeads(head);
      this.state.head = head;
      return this.setView("heatmap");
    }
    /* The window head view's tokens: `width` tokens from `start` (clamped to the input). */
    setWindow(start, width) {
      const w = Math.max(1, Math.min(this.payload.window.max_width, width, this.tokens));
      this.state.window = { start: Math.max(0, Math.min(this.tokens - w, Math.round(start))), width: w };
      this.views.window.syncInputs();
    }
  }

  function compactList(numbers) {
    const contiguous = numbers.every((n, i) => i === 0 || n === numbers[i - 1] + 1);
    return contiguous && numbers.length > 2 ? `${numbers[0]}\u2013${numbers[numbers.length - 1]}` : numbers.join(", ");
  }

  // ---- heatmap ------------------------------------------------------------------------------
  class Heatmap {
    constructor(app, container) {
      this.app = app;
      this.scene = null;
      this.zoom = { q0: 0, k0: 0, span: app.tokens }; // in sight: queries [q0, q0 + span), keys [k0, k0 + span)
      this.hovered = null;
      const controls = el("div", "as-controls");
      for (const [role, text, factor] of [["zoom-in", "zoom in", 0.5], ["zoom-out", "zoom out", 2], ["zoom-reset", "whole matrix", 0]]) {
        const button = el("button", "as-export", text);
        button.type = "button";
        button.dataset.role = role;
        button.addEventListener("click", () => (factor ? this.zoomBy(factor, 0.5, 0.5) : this.setZoom(0, 0, app.tokens)));
        controls.append(button);
      }
      controls.append(el("span", "as-hint", "wheel or buttons: zoom \u00b7 drag: pan \u00b7 click: window for the window head view"));
      this.canvas = el("canvas", "as-heatmap");
      this.canvas.dataset.role = "heatmap-canvas";
      this.canvas.style.cursor = "crosshair";
      this.readout = el("div", "as-status");
      this.readout.dataset.role = "heatmap-readout";
      container.append(controls, this.canvas, this.readout);
      this.listen();
    }

    get perToken() { return PLOT / this.zoom.span; } // CSS px per token
    /* Zoomed out: the overview; a pixel holds at most one token: the top-k rows. */
    get mode() { return this.zoom.span <= PLOT ? "top-k" : "overview"; }

    prepare() {
      const { layer, head } = this.app.state;
      if (this.mode === "overview") return this.app.overview(layer, head).then((cells) => ({ cells }));
      return this.app.headRows(layer, head).then((rows) => ({ rows }));
    }

    render(data) {
      const app = this.app;
      const scene = new NS.Scene(LEFT + PLOT + 24, TOP + PLOT + 24);
      scene.rect(0, 0, scene.width, scene.height, { fill: OUTSIDE });
      if (data.cells) this.drawOverview(scene, data.cells); else this.drawRows(scene, data.rows);
      // the matrix may end inside the plot, and the image may overhang it: cover the margins
      scene.rect(0, 0, scene.width, TOP, { fill: "#ffffff" });
      scene.rect(0, 0, LEFT, scene.height, { fill: "#ffffff" });
      scene.rect(LEFT + PLOT, 0, scene.width, scene.height, { fill: "#ffffff" });
      scene.rect(0, TOP + PLOT, scene.width, scene.height, { fill: "#ffffff" });
      scene.rect(LEFT - 0.5, TOP - 0.5, PLOT + 1, PLOT + 1, { stroke: "#888" });
      this.drawCaption(scene);
      if (this.zoom.span < LABEL_SPAN) this.drawLabels(scene); else this.drawTicks(scene);
      this.scene = scene;
      this.drawnWith = data;
      NS.paint(scene, this.canvas);
    }

    drawCaption(scene) {
      const app = this.app;
      const { q0, k0, span } = this.zoom;
      const last = (start) => Math.min(app.tokens, Math.ceil(start + span)) - 1;
      const source = this.mode === "overview"
        ? `overview: blocks of ${app.payload.overview.block} tokens (mean over a block's queries of their summed weight on a key block, per token pair)`
        : app.state.head === "mean"
          ? `mean over the heads of the top ${app.payload.top_k.k} keys of each query (a key outside a head's top-k counts 0; other keys blank)`
          : `top ${app.payload.top_k.k} keys of each query (exact weights; other keys blank)`;
      scene.text(8, 12, `layer ${app.layerName()} \u00b7 ${app.headLabel()} (0-indexed) \u00b7 queries ${Math.floor(q0)}\u2013${last(q0)} (down) \u00d7 keys ${Math.floor(k0)}\u2013${last(k0)} (across)`,
        { size: 12, weight: "bold" });
      scene.text(8, 30, source, { size: 11, color: "#555" });
      const legend = blank(128, 1);
      for (let x = 0; x < 128; x++) app.scale.paint(legend.data, x * 4, Math.pow(10, -app.scale.decades * (1 - x / 127)));
      scene.text(8, 48, "weight per token pair (log scale):", { size: 11, color: "#555" });
      scene.text(236, 48, app.scale.floor.toPrecision(1), { size: 10, color: "#555", align: "right" });
      scene.image(240, 42, 128, 12, legend, { role: "legend" });
      scene.text(372, 48, "1", { size: 10, color: "#555" });
      scene.rect(390, 42, 12, 12, { fill: "#ffffff", stroke: "#aaa" });
      scene.text(406, 48, this.mode === "overview" ? "0" : "not in the top-k", { size: 10, color: "#555" });
      if (app.payload.causal) {
        scene.rect(500, 42, 12, 12, { fill: `rgb(${MASKED.slice(0, 3).join(",")})` });
        scene.text(516, 48, "masked (key after query)", { size: 10, color: "#555" });
      }
    }

    /* Overview cells in sight, one pixel per cell, stretched to the plot. */
    drawOverview(scene, cells) {
      const app = this.app;
      const block = app.payload.overview.block;
      const size = app.payload.overview.size;
      const { q0, k0, span } = this.zoom;
      const [i0, i1] = [Math.floor(q0 / block), Math.min(size, Math.ceil((q0 + span) / block))];
      const [j0, j1] = [Math.floor(k0 / block), Math.min(size, Math.ceil((k0 + span) / block))];
      const pixels = blank(j1 - j0, i1 - i0);
      for (let i = i0; i < i1; i++) {
        const lastQuery = Math.min(app.tokens, (i + 1) * block) - 1;
        for (let j = j0; j < j1; j++) {
          const at = ((i - i0) * (j1 - j0) + (j - j0)) * 4;
          if (app.payload.causal && j * block > lastQuery) { pixels.data.set(MASKED, at); continue; }
          const keys = Math.min(app.tokens, (j + 1) * block) - j * block;
          app.scale.paint(pixels.data, at, cells[i * size + j] / keys);
        }
      }
      const per = this.perToken;
      scene.image(LEFT + (j0 * block - k0) * per, TOP + (i0 * block - q0) * per, (j1 - j0) * block * per, (i1 - i0) * block * per,
        pixels, { role: "matrix" });
      this.coverPastTheEnd(scene);
    }

    /* The top-k weights of the queries in sight, one pixel per token (mean: summed over heads / heads). */
    drawRows(scene, rows) {
      const app = this.app;
      const n = app.tokens;
      const { q0, k0, span } = this.zoom;
      const [qa, qb] = [Math.floor(q0), Math.min(n, Math.ceil(q0 + span))];
      const [ka, kb] = [Math.floor(k0), Math.min(n, Math.ceil(k0 + span))];
      const width = kb - ka;
      const sums = new Float32Array((qb - qa) * width);
      for (const { keys, weights, k } of rows) {
        for (let q = qa; q < qb; q++) {
          for (let r = 0; r < k; r++) {
            const key = keys[r * n + q];
            const weight = weights[r * n + q];
            if (weight > 0 && key >= ka && key < kb) sums[(q - qa) * width + key - ka] += weight / rows.length;
          }
        }
      }
      const pixels = blank(width, qb - qa);
      for (let q = qa; q < qb; q++) {
        for (let key = ka; key < kb; key++) {
          const at = ((q - qa) * width + key - ka) * 4;
          if (app.payload.causal && key > q) pixels.data.set(MASKED, at);
          else app.scale.paint(pixels.data, at, sums[(q - qa) * width + key - ka]);
        }
      }
      const per = this.perToken;
      scene.image(LEFT + (ka - k0) * per, TOP + (qa - q0) * per, width * per, (qb - qa) * per, pixels, { role: "matrix" });
      this.coverPastTheEnd(scene);
    }

    /* Grey out plot area past the last token (the view may be wider than what is left of the input). */
    coverPastTheEnd(scene) {
      const end = (this.app.tokens - this.zoom.k0) * this.perToken;
      if (end < PLOT) scene.rect(LEFT + end, TOP, PLOT - end, PLOT, { fill: OUTSIDE });
      const bottom = (this.app.tokens - this.zoom.q0) * this.perToken;
      if (bottom < PLOT) scene.rect(LEFT, TOP + bottom, PLOT, PLOT - bottom, { fill: OUTSIDE });
    }

    /* Token labels: queries left of their row, keys turned above their column. */
    drawLabels(scene) {
      const app = this.app;
      const per = this.perToken;
      const size = Math.max(7, Math.min(11, per - 1));
      const { q0, k0, span } = this.zoom;
      for (let pos = Math.ceil(q0 - 0.5); pos < Math.min(app.tokens, q0 + span); pos++) {
        if (pos < 0) continue;
        const y = TOP + (pos + 0.5 - q0) * per;
        if (y < TOP || y > TOP + PLOT) continue;
        scene.text(LEFT - 4, y, NS.label(app.payload.tokens[pos], 16), { size, align: "right", color: app.payload.special[pos] ? "#777" : "#222" },
          { role: "label", axis: "query", pos });
      }
      for (let pos = Math.ceil(k0 - 0.5); pos < Math.min(app.tokens, k0 + span); pos++) {
        if (pos < 0) continue;
        const x = LEFT + (pos + 0.5 - k0) * per;
        if (x < LEFT || x > LEFT + PLOT) continue;
        scene.text(x, TOP - 4, NS.label(app.payload.tokens[pos], 12), { size, rotate: -60, color: app.payload.special[pos] ? "#777" : "#222" },
          { role: "label", axis: "key", pos });
      }
    }

    /* Position ticks when labels would not be readable. */
    drawTicks(scene) {
      const { q0, k0, span } = this.zoom;
      const step = niceStep(span / 8);
      for (let pos = Math.ceil(q0 / step) * step; pos < Math.min(this.app.tokens, q0 + span); pos += step) {
        scene.text(LEFT - 4, TOP + (pos - q0) * this.perToken, String(pos), { size: 10, align: "right", color: "#555" }, { role: "tick" });
      }
      for (let pos = Math.ceil(k0 / step) * step; pos < Math.min(this.app.tokens, k0 + span); pos += step) {
        scene.text(LEFT + (pos - k0) * this.perToken, TOP - 8, String(pos), { size: 10, align: "center", color: "#555" }, { role: "tick" });
      }
    }

    // ---- interaction --------------------------------------------------------------------------
    setZoom(q0, k0, span) {
      const n = this.app.tokens;
      const s = Math.max(Math.min(MIN_SPAN, n), Math.min(n, span));
      this.zoom = { q0: Math.max(0, Math.min(n - s, q0)), k0: Math.max(0, Math.min(n - s, k0)), span: s };
      return this.app.draw();
    }
    /* Zoom by `factor` keeping the point at fractions (fx, fy) of the plot where it is. */
    zoomBy(factor, fx, fy) {
      const { q0, k0, span } = this.zoom;
      const s = Math.max(MIN_SPAN, Math.min(this.app.tokens, span * factor));
      return this.setZoom(q0 + fy * (span - s), k0 + fx * (span - s), s);
    }
    /* Plot point of an event: fractions of the plot and the (query, key) under it, or null outside. */
    at(event) {
      const box = this.canvas.getBoundingClientRect();
      const fx = (event.clientX - box.left - LEFT) / PLOT;
      const fy = (event.clientY - box.top - TOP) / PLOT;
      if (fx < 0 || fx >= 1 || fy < 0 || fy >= 1) return null;
      const query = Math.floor(this.zoom.q0 + fy * this.zoom.span);
      const key = Math.floor(this.zoom.k0 + fx * this.zoom.span);
      return query < this.app.tokens && key < this.app.tokens ? { fx, fy, query, key } : null;
    }

    listen() {
      const c = this.canvas;
      c.addEventListener("wheel", (event) => {
        const point = this.at(event);
        if (!point) return;
        event.preventDefault();
        this.zoomBy(Math.exp(event.deltaY * 0.002), point.fx, point.fy);
      }, { passive: false });
      let drag = null;
      c.addEventListener("mousedown", (event) => {
        drag = { x: event.clientX, y: event.clientY, zoom: { ...this.zoom }, moved: false };
      });
      window.addEventListener("mouseup", (event) => {
        if (drag && !drag.moved) this.pick(event);
        drag = null;
      });
      c.addEventListener("mousemove", (event) => {
        if (drag && event.buttons & 1) {
          const dx = event.clientX - drag.x;
          const dy = event.clientY - drag.y;
          if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
          if (drag.moved) this.setZoom(drag.zoom.q0 - dy / this.perToken, drag.zoom.k0 - dx / this.perToken, drag.zoom.span);
          return;
        }
        this.hover(this.at(event));
      });
      c.addEventListener("mouseleave", () => this.hover(null));
    }

    /* A click picks the window head view's tokens: a window around the clicked query and key. */
    pick(event) {
      const point = this.at(event);
      if (!point) return;
      const width = this.app.state.window.width;
      this.app.setWindow((point.query + point.key) / 2 - width / 2, width);
      const { start } = this.app.state.window;
      this.readout.textContent = `window head view: tokens ${start}\u2013${start + this.app.state.window.width - 1} (open the Window head view tab)`;
    }

    /* Write query, key and weight under the mouse (for tests: this.hovered). */
    hover(point) {
      this.hovered = point ? this.describe(point.query, point.key) : null;
      this.readout.textContent = this.hovered ? this.hovered.text : "";
    }

    /* What the heatmap shows at (query, key): {query, key, weight | null, text}. */
    describe(query, key) {
      const app = this.app;
      const tokens = app.payload.tokens;
      const pair = `query ${query} \u201c${NS.label(tokens[query], 24)}\u201d \u2192 key ${key} \u201c${NS.label(tokens[key], 24)}\u201d`;
      if (app.payload.causal && key > query) return { query, key, weight: 0, text: `${pair}: masked (key after query)` };
      const data = this.drawnWith;
      if (data && data.cells) {
        const block = app.payload.overview.block;
        const [i, j] = [Math.floor(query / block), Math.floor(key / block)];
        const value = data.cells[i * app.payload.overview.size + j];
        const range = (b) => `${b * block}\u2013${Math.min(app.tokens, (b + 1) * block) - 1}`;
        return { query, key, weight: null, block: value,
          text: `${pair}: in the block of queries ${range(i)} \u2192 keys ${range(j)}, mean summed weight ${value.toFixed(4)}` };
      }
      let weight = 0;
      let found = false;
      for (const { keys, weights, k } of data ? data.rows : []) {
        for (let r = 0; r < k; r++) {
          const at = r * app.tokens + query;
          if (weights[at] > 0 && keys[at] === key) { weight += weights[at] / data.rows.length; found = true; }
        }
      }
      const k = app.payload.top_k.k;
      const what = data.rows.length > 1 ? `mean over the heads of their top-${k} weights` : "weight";
      const text = found ? `${pair}: ${what} ${weight.toFixed(4)}` : `${pair}: not among the query's top ${k} keys`;
      return { query, key, weight: found ? weight : null, text };
    }

    /* For tests: the viewport point of (query, key) in the plot, or null if out of sight. */
    cellPoint(query, key) {
      const box = this.canvas.getBoundingClientRect();
      const x = LEFT + (key + 0.5 - this.zoom.k0) * this.perToken;
      const y = TOP + (query + 0.5 - this.zoom.q0) * this.perToken;
      if (x < LEFT || x >= LEFT + PLOT || y < TOP || y >= TOP + PLOT) return null;
      return { x: box.left + x, y: box.top + y };
    }
  }

  function niceStep(raw) {
    const power = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1))));
    for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
    return 10 * power;
  }

  // ---- model view: thumbnails ----------------------------------------------------------------
  class Thumbnails {
    constructor(app, container) {
      this.app = app;
      this.scene = null;
      this.pixels = new Map();
      const wrap = el("div", "as-canvas-wrap as-clickable");
      this.surface = new NS.Surface(wrap, "model-canvas");
      this.canvas = this.surface.canvas;
      container.append(el("div", "as-hint", "Block-averaged attention of every head (log colour scale). Click a thumbnail to open it in the heatmap."), wrap);
      this.canvas.addEventListener("click", (event) => {
        const hit = this.hit(event);
        if (hit) this.app.openHead(hit.layer, hit.head);
      });
      this.canvas.addEventListener("mousemove", (event) => {
        const hit = this.hit(event);
        this.canvas.title = hit ? `layer ${this.app.payload.layers[hit.layer]}, head ${this.app.payload.heads[hit.head]} (0-indexed): click to open in the heatmap` : "";
      });
    }

    prepare() { return this.app.thumbnails().then((cells) => ({ cells })); }

    render({ cells }) {
      const p = this.app.payload;
      const step = THUMB + THUMB_GAP;
      const scene = new NS.Scene(Math.max(480, LEFT / 2 + p.heads.length * step + 8), 40 + p.layers.length * step + 8);
      this.origin = { x: LEFT / 2, y: 40 };
      scene.text(8, 10, "layers x heads (0-indexed) \u00b7 block-averaged attention, log colour scale", { size: 12, weight: "bold" });
      p.heads.forEach((head, h) => scene.text(this.origin.x + h * step + THUMB / 2, 30, String(head), { size: 10, align: "center", color: "#555" }));
      p.layers.forEach((layer, l) => {
        const y = this.origin.y + l * step;
        scene.text(this.origin.x - 6, y + THUMB / 2, String(layer), { size: 10, align: "right", color: "#555" });
        p.heads.forEach((_, h) => {
          const x = this.origin.x + h * step;
          scene.image(x, y, THUMB, THUMB, this.thumbnail(cells, l, h), { layer: l, head: h });
          const current = l === this.app.state.layer && h === this.app.state.head;
          scene.rect(x - 0.5, y - 0.5, THUMB + 1, THUMB + 1, { stroke: current ? "#222" : "#ccc", lineWidth: current ? 2 : 1 });
        });
      });
      this.scene = scene;
      this.surface.show(scene);
    }

    thumbnail(cells, layer, head) {
      const name = `${layer}:${head}`;
      if (this.pixels.has(name)) return this.pixels.get(name);
      const app = this.app;
      const { size, block } = app.payload.thumbnails;
      const start = (layer * app.payload.heads.length + head) * size * size;
      const pixels = blank(size, size);
      for (let i = 0; i < size; i++) {
        const lastQuery = Math.min(app.tokens, (i + 1) * block) - 1;
        for (let j = 0; j < size; j++) {
          const at = (i * size + j) * 4;
          if (app.payload.causal && j * block > lastQuery) pixels.data.set(MASKED, at);
          else app.scale.paint(pixels.data, at, cells[start + i * size + j] / (Math.min(app.tokens, (j + 1) * block) - j * block));
        }
      }
      this.pixels.set(name, pixels);
      return pixels;
    }

    hit(event) {
      if (!this.origin) return null;
      const at = this.surface.at(event);
      const step = THUMB + THUMB_GAP;
      const x = at.x - this.origin.x;
      const y = at.y - this.origin.y;
      const head = Math.floor(x / step);
      const layer = Math.floor(y / step);
      if (x < 0 || y < 0 || x % step > THUMB || y % step > THUMB) return null;
      if (head >= this.app.payload.heads.length || layer >= this.app.payload.layers.length) return null;
      return { layer, head };
    }

    /* For tests: the centre of a thumbnail in viewport coordinates. */
    thumbnailPoint(layer, head) {
      const step = THUMB + THUMB_GAP;
      return this.surface.point(this.origin.x + head * step + THUMB / 2, this.origin.y + layer * step + THUMB / 2);
    }
  }

  // ---- window head view ------------------------------------------------------------------------
  /* What NS.HeadView reads from its app, for the tokens of the window: a uint8 grid [1, head, W, W]
   * of the top-k weights that fall inside the window (round(weight * 255); others 0, not drawn). */
  class WindowHeads {
    constructor(app) {
      this.app = app;
      this.state = { filter: "all", hideSpecial: false, heads: new Set(app.payload.heads.map((_, h) => h)), layer: 0,
        selected: null };
      this.payload = { sides: { input: { tokens: [], special: [], sentence: [] } } };
      this.windowGrid = null;
      this.view = null; // the NS.HeadView, set by WindowView
    }
    kind() {
      const { start, width } = this.app.state.window;
      return { label: `tokens ${start}\u2013${start + width - 1}`, query_side: "input", key_side: "input", causal: this.app.payload.causal };
    }
    nHeads() { return this.app.payload.heads.length; }
    headName(head) { return this.app.payload.heads[head]; }
    layerName(layer) { return layer; } // state.layer already holds the model's number (see fill)
    window() { return 0; } // the long view's payload names no sliding windows: the head view greys no keys
    chunked() { return false; }
    grid() { return this.windowGrid; }
    weightName() { return `\u03b1, top ${this.app.payload.top_k.k} keys per query`; }
    formatWeight(value) { return value.toFixed(3); }
    toggleHead(head) {
      if (this.state.heads.has(head)) this.state.heads.delete(head); else this.state.heads.add(head);
      return this.app.draw();
    }
    soloHead(head) { this.state.heads = NS.soloHeads(this.state.heads, head, this.nHeads()); return this.app.draw(); }

    /* Tokens and weights of the current window and layer. */
    fill(rows) {
      const app = this.app;
      const { start, width } = app.state.window;
      const n = app.tokens;
      const p = app.payload;
      this.state.layer = app.layerName();
      this.payload.sides.input = { tokens: p.tokens.slice(start, start + width), special: p.special.slice(start, start + width),
        sentence: new Array(width).fill(0) };
      const bytes = new Uint8Array(rows.length * width * width);
      rows.forEach(({ keys, weights, k }, head) => {
        for (let q = start; q < start + width; q++) {
          for (let r = 0; r < k; r++) {
            const key = keys[r * n + q];
            if (key >= start && key < start + width) bytes[(head * width + q - start) * width + key - start] = Math.round(weights[r * n + q] * 255);
          }
        }
      });
      this.windowGrid = {
        shape: [1, rows.length, width, width],
        row: (layer, head, query) => bytes.subarray((head * width + query) * width, (head * width + query + 1) * width),
        value: (layer, byte) => byte / 255,
      };
    }
  }

  class WindowView {
    constructor(app, container) {
      this.app = app;
      const controls = el("div", "as-controls");
      const startLabel = el("label", "as-control");
      this.start = el("input");
      this.start.type = "number";
      this.start.min = "0";
      this.start.max = String(app.tokens - 1);
      this.start.dataset.role = "window-start";
      startLabel.append("first token ", this.start);
      const [widthLabel, width] = NS.control("select", "width", "window-width");
      for (const w of [16, 32, 64, 128]) if (w <= app.payload.window.max_width) width.append(new Option(String(w), String(w)));
      this.width = width;
      controls.append(startLabel, widthLabel);
      const apply = () => { app.setWindow(Number(this.start.value) || 0, Number(this.width.value)); return app.draw(); };
      this.start.addEventListener("change", apply);
      width.addEventListener("change", apply);
      container.append(controls, el("div", "as-hint",
        `Lines come from the top ${app.payload.top_k.k} keys of each query inside the window (weights below 0.5/255 are not drawn); ` +
        "click the heatmap to centre the window on a cell."));
      const panel = el("div");
      container.append(panel);
      this.heads = new WindowHeads(app);
      this.view = new NS.HeadView(this.heads, panel);
      this.canvas = this.view.canvas;
      this.showHeads(app.state.head);
      this.syncInputs();
    }

    /* The heatmap's choice of head carries over: one head, or all of them for the mean. */
    showHeads(head) {
      this.heads.state.heads = new Set(head === "mean" ? this.app.payload.heads.map((_, h) => h) : [head]);
    }

    syncInputs() {
      const { start, width } = this.app.state.window;
      this.start.value = String(start);
      if (![...this.width.options].some((o) => o.value === String(width))) this.width.append(new Option(String(width), String(width)));
      this.width.value = String(width);
    }

    prepare() { return this.app.headRows(this.app.state.layer, "mean").then((rows) => ({ rows })); }

    render({ rows }) {
      this.heads.fill(rows);
      this.view.sync();
      this.view.render();
    }

    /* For tests and tools: every drawn line as {head (model's number), q_pos, k_pos (input positions), weight}. */
    lines() {
      const start = this.app.state.window.start;
      return this.view.drawnLines().map((line) => ({ ...line, head: this.app.payload.heads[line.head],
        q_pos: line.q_pos + start, k_pos: line.k_pos + start }));
    }
  }

  NS.mountLong = function mountLong(root, payload) {
    const app = new LongApp(root, payload);
    NS.instances = NS.instances || {};
    NS.instances[root.id] = app;
    app.draw();
    return app;
  };
})((window.AttnscopeViews = window.AttnscopeViews || {}));
