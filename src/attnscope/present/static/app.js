/* attnscope views: the page around the views — toolbar, shared state, decoding, export.
 *
 * AttnscopeViews.mount(root, payload) builds one instance in `root` (several can share a page,
 * e.g. in a notebook) and registers it in AttnscopeViews.instances[root.id]. When the first view
 * has drawn it sets performance mark "attnscope:<root id>:drawn" and root.dataset.drawn.
 *
 * The measure control chooses what the views draw: attention α and ‖αf(x)‖ (per head), or a
 * context-mixing measure of the input side (payload kinds[i].mixing, or fetched on demand through
 * options.mixing in the explorer). A mixing measure is one map per layer, no head axis: it is
 * decoded as a grid [layer, 1, q_pos, k_pos] (one pseudo-head) and drawn in NEUTRAL grey; a second
 * control picks the layer's own map or the rollout through the layer.
 */
(function (NS) {
  "use strict";

  const VIEW_NAMES = { head: "Head view", model: "Model view", neuron: "Neuron view" };
  const VIEW_CLASSES = { head: () => NS.HeadView, model: () => NS.ModelView, neuron: () => NS.NeuronView };
  const PER_HEAD = { attention: ["attention \u03b1", "the attention weights"],
    norms: ["\u2016\u03b1f(x)\u2016", "norm of the weighted transformed vectors, Kobayashi et al. 2020"] };
  const MIXING_KINDS = ["self", "encoder"]; // the context-mixing measures are defined on the input side
  NS.NEUTRAL = "#444"; // the colour of a layer-level measure (it has no heads to colour)
  /* The control's value of a mixing method: its name, but the head mean of attention is not α itself. */
  const mixingValue = (method) => (method === "attention" ? "attention_mean" : method);

  class App {
    constructor(root, payload) {
      this.root = root;
      this.payload = payload;
      this.decoded = new Map(); // "<kind index>:<field>" -> Promise of a decoded grid
      this.ready = new Map(); // same keys -> the decoded grid, once done
      this.drawCount = 0;
      this.lastExport = null;
      const heads = payload.model.n_heads;
      this.state = {
        view: payload.views[0], kind: 0, layer: 0, heads: new Set(Array.from({ length: heads }, (_, h) => h)),
        measure: "attention", rollout: false, filter: "all", hideSpecial: false, neuronHead: 0, query: 0, selected: null,
      };
      this.applyStart(payload.start || {});
      this.build();
    }

    /* payload.start: the layer (a model number) and heads the page opens on (view(rec, layer=, heads=)). */
    applyStart(start) {
      const layer = this.layerIndex(start.layer);
      if (layer !== null) this.state.layer = layer;
      if (start.heads) {
        this.state.heads = new Set(start.heads);
        this.state.neuronHead = start.heads[0];
      }
    }

    // ---- state helpers used by the views -------------------------------------------------
    kind() { return this.payload.kinds[this.state.kind]; }
    /* The measures the current kind can draw: [{value, label, title}], per-head ones first. */
    measures() {
      const kind = this.kind();
      const offered = [{ value: "attention", label: PER_HEAD.attention[0], title: PER_HEAD.attention[1] }];
      if (kind.norms) offered.push({ value: "norms", label: PER_HEAD.norms[0], title: PER_HEAD.norms[1] });
      if (!MIXING_KINDS.includes(kind.kind)) return offered;
      const shipped = kind.mixing || [];
      const fetchable = this.mixingSource ? this.mixingSource.methods : [];
      // in the fetchable list's order (a fetched measure keeps its place), then any other shipped one
      const listed = [...fetchable, ...shipped.filter((s) => !fetchable.some((m) => m.method === s.method))];
      for (const entry of listed) {
        offered.push({ value: mixingValue(entry.method), label: entry.label, title: `${entry.reference}; one map per layer (no heads)` });
      }
      return offered;
    }
    /* True when the chosen measure is a context-mixing measure: one map per layer, no head axis. */
    layerLevel() { return !(this.state.measure in PER_HEAD); }
    mixingEntry() { return (this.kind().mixing || []).find((entry) => mixingValue(entry.method) === this.state.measure) || null; }
    field() {
      if (this.layerLevel()) return `mixing:${this.state.measure}:${this.state.rollout ? "rollout" : "layers"}`;
      return this.state.measure === "norms" && this.kind().norms ? "norms" : "attention";
    }
    nHeads() { return this.kind().attention.shape[1]; }
    /* The heads whose lines are drawn, and their colour: one neutral line set for a layer-level measure. */
    lineHeads() { return this.layerLevel() ? [0] : [...this.state.heads].sort((a, b) => a - b); }
    lineColor(head) { return this.layerLevel() ? NS.NEUTRAL : NS.headColor(head); }
    /* The model's number of layer index `index` (payload.layers when only some layers were shipped). */
    layerName(index) { return this.payload.layers ? this.payload.layers[index] : index; }
    /* The index of model layer `number` in the shipped arrays, or null if it was not shipped. */
    layerIndex(number) {
      if (!Number.isInteger(number)) return null;
      const index = this.payload.layers ? this.payload.layers.indexOf(number) : number;
      return index >= 0 && index < this.kind().attention.shape[0] ? index : null;
    }
    /* The window of shipped layer `index` in keys, 0 when it sees every key: sliding (query q sees q - window + 1
       .. q) or a chunk (chunked below); only the input side's self-attention has one (model.windows, one per
       model layer, empty when none does). */
    window(index) {
      const windows = this.payload.model.windows || [];
      return ["self", "encoder"].includes(this.kind().kind) ? windows[this.layerName(index)] || 0 : 0;
    }
    /* Whether shipped layer `index`'s window is a chunk (query q sees (q // window) * window .. q: Llama 4's
       chunked layers, model.chunked) rather than a sliding window. */
    chunked(index) { return this.window(index) > 0 && (this.payload.model.chunked || []).includes(this.layerName(index)); }
    grid() { return this.ready.get(`${this.state.kind}:${this.field()}`); }
    /* Learned sinks (gpt-oss): the current kind's sink mass of `head` at `query` in shipped layer `layer`
     * (the share of the softmax on the sink logit), or null when the model has none. */
    sinkMass(layer, head, query) {
      const values = this.ready.get(`${this.state.kind}:sink_mass`);
      if (!values) return null;
      const [, nHeads, nQueries] = this.kind().sink_mass.shape;
      return values[(layer * nHeads + head) * nQueries + query];
    }
    /* A layer-level measure's decoded grid [layer, 1, q_pos, k_pos]: `which` is "layers" or "rollout". */
    mixingGrid(which) { return this.ready.get(`${this.state.kind}:mixing:${this.state.measure}:${which}`); }
    weightName() {
      if (this.layerLevel()) {
        const entry = this.mixingEntry();
        const what = this.state.rollout ? "rollout through this layer" : "this layer's map";
        return `${entry ? entry.reference : this.state.measure}, ${what}`;
      }
      return this.field() === "norms" ? "\u2016\u03b1f(x)\u2016 (Kobayashi et al. 2020)" : "attention weight \u03b1";
    }
    formatWeight(value) { return this.field() === "attention" ? value.toFixed(3) : value.toPrecision(3); }
    vectors() {
      const kind = this.kind();
      if (!kind.vectors) return null;
      return { queries: this.ready.get(`${this.state.kind}:queries`), keys: this.ready.get(`${this.state.kind}:keys`),
        nKvHeads: kind.vectors.n_kv_heads };
    }

    // ---- page ------------------------------------------------------------------------------
    build() {
      const p = this.payload;
      const el = NS.element;
      const header = el("div", "as-header");
      header.append(el("div", "as-title", p.title));
      const m = p.model;
      const kv = m.n_kv_heads !== m.n_heads ? ` (${m.n_kv_heads} key/value heads)` : "";
      const chunked = m.chunked || [];
      const sliding = (m.windows || []).filter((w, layer) => w > 0 && !chunked.includes(layer));
      const chunks = chunked.map((layer) => m.windows[layer]);
      const slide = (sliding.length ? `; ${sliding.length} layers slide over a window of ${Math.max(...sliding)} keys (grey beyond it)` : "")
        + (chunks.length ? `; ${chunks.length} layers see chunks of ${Math.max(...chunks)} keys (grey beyond them)` : "");
      header.append(el("div", "as-subtitle",
        `${m.model_type}: ${m.n_layers} layers x ${m.n_heads} heads${kv}${m.d_head ? `, d_head ${m.d_head}` : ""}${slide}; layers and heads are 0-indexed`));
      for (const note of p.notes) header.append(el("div", "as-note", note));
      const bar = el("div", "as-toolbar");
      this.tabs = NS.tabs(p.views.map((name) => [name, VIEW_NAMES[name]]), (name) => this.setView(name));
      bar.append(this.tabs);
      if (p.kinds.length > 1) {
        const [label, select] = NS.control("select", "Attention", "kind");
        this.kindSelect = select;
        p.kinds.forEach((kind, i) => select.append(new Option(kind.label, String(i))));
        select.addEventListener("change", () => this.setKind(Number(select.value)));
        bar.append(label);
      }
      [this.layerLabel, this.layerSelect] = NS.control("select", "Layer", "layer");
      this.layerSelect.addEventListener("change", () => this.setLayer(Number(this.layerSelect.value)));
      bar.append(this.layerLabel);
      [this.measureLabel, this.measureSelect] = NS.control("select", "Measure", "measure");
      this.measureSelect.addEventListener("change", () => this.setMeasure(this.measureSelect.value));
      [this.aggregateLabel, this.aggregateSelect] = NS.control("select", "of", "aggregate");
      this.aggregateSelect.append(new Option("this layer", "layer"), new Option("rollout through this layer", "rollout"));
      this.aggregateLabel.title = "the layer's own map, or the maps of layers 0..this one aggregated by rollout (Abnar & Zuidema 2020)";
      this.aggregateSelect.addEventListener("change", () => this.setMeasure(this.state.measure, this.aggregateSelect.value === "rollout"));
      bar.append(this.measureLabel, this.aggregateLabel);
      for (const format of ["svg", "png"]) {
        const button = el("button", "as-export", `Export ${format.toUpperCase()}`);
        button.type = "button";
        button.dataset.role = `export-${format}`;
        button.addEventListener("click", () => this.download(format));
        bar.append(button);
      }
      this.status = el("div", "as-status", "decoding\u2026");
      this.panels = {};
      this.views = {};
      const body = el("div", "as-body");
      for (const name of p.views) {
        const panel = el("div", "as-panel");
        panel.dataset.view = name;
        this.panels[name] = panel;
        this.views[name] = new (VIEW_CLASSES[name]())(this, panel);
        body.append(panel);
      }
      this.root.classList.add("attnscope-root");
      this.root.replaceChildren(header, bar, this.status, body);
      this.syncControls();
    }

    syncControls() {
      const layers = this.kind().attention.shape[0];
      this.state.layer = Math.min(this.state.layer, layers - 1);
      this.layerSelect.replaceChildren(...Array.from({ length: layers }, (_, l) => new Option(String(this.layerName(l)), String(l))));
      this.layerSelect.value = String(this.state.layer);
      if (this.kindSelect) this.kindSelect.value = String(this.state.kind);
      this.syncMeasure();
      for (const tab of this.tabs.children) tab.classList.toggle("as-active", tab.dataset.view === this.state.view);
      for (const [name, panel] of Object.entries(this.panels)) panel.hidden = name !== this.state.view;
      this.layerLabel.hidden = this.state.view === "model";
      for (const view of Object.values(this.views)) view.sync();
    }

    /* The measure control lists what the current kind offers (a measure it lacks falls back to α). */
    syncMeasure() {
      const offered = this.measures();
      if (!offered.some((m) => m.value === this.state.measure)) this.state.measure = "attention";
      this.measureSelect.replaceChildren(...offered.map((m) => {
        const option = new Option(m.label, m.value);
        option.title = m.title;
        return option;
      }));
      this.measureSelect.value = this.state.measure;
      this.measureSelect.title = offered.find((m) => m.value === this.state.measure).title;
      this.measureLabel.hidden = offered.length < 2;
      this.aggregateLabel.hidden = !this.layerLevel();
      this.aggregateSelect.value = this.state.rollout ? "rollout" : "layer";
    }

    // ---- decoding (lazy: only what the current kind and view need) ---------------------------
    needed() {
      const kind = this.kind();
      if (this.layerLevel()) {
        const entry = this.mixingEntry();
        // the model view draws a layer's map and its rollout side by side
        const which = this.state.view === "model" ? ["layers", "rollout"] : [this.state.rollout ? "rollout" : "layers"];
        const fields = which.map((part) => [`${this.state.kind}:mixing:${this.state.measure}:${part}`, headless(entry[part])]);
        if (this.state.view === "neuron" && kind.vectors) fields.push(...["queries", "keys"].map((f) => [`${this.state.kind}:${f}`, kind.vectors[f]]));
        return fields;
      }
      const fields = [this.field()];
      if (this.state.view === "neuron" && kind.vectors) fields.push("queries", "keys");
      return fields.map((field) => [`${this.state.kind}:${field}`,
        field === "queries" || field === "keys" ? kind.vectors[field] : kind[field]]);
    }

    /* A mixing measure the payload lacks but options.mixing offers: fetched once, then kept in the payload. */
    async fetchMixing() {
      if (!this.layerLevel() || this.mixingEntry()) return;
      const method = this.mixingSource.methods.find((m) => mixingValue(m.method) === this.state.measure).method;
      const kind = this.kind();
      if (!this.pendingMixing) this.pendingMixing = new Map();
      const key = `${this.state.kind}:${method}`;
      if (!this.pendingMixing.has(key)) {
        this.status.textContent = `computing ${method}\u2026`;
        this.pendingMixing.set(key, this.mixingSource.fetch(method).then((entry) => {
          kind.mixing = [...(kind.mixing || []).filter((e) => e.method !== entry.method), entry];
        }).catch((error) => {
          this.pendingMixing.delete(key); // asked again if chosen again
          throw new Error(`${method}: ${error.message}`);
        }));
      }
      try {
        await this.pendingMixing.get(key);
      } catch (error) {
        // draw α instead, the control showing it, and say why under the toolbar
        this.notice = `attnscope: cannot show ${error.message}`;
        this.state.measure = "attention";
        this.syncControls();
      }
    }

    async ensure() {
      await this.fetchMixing();
      const sinks = this.kind().sink_mass;
      const sinkKey = `${this.state.kind}:sink_mass`;
      if (sinks && !this.decoded.has(sinkKey)) {
        this.decoded.set(sinkKey, NS.unpackNumbers(sinks).then((values) => { this.ready.set(sinkKey, values); return values; }));
      }
      if (sinks) await this.decoded.get(sinkKey);
      await Promise.all(this.needed().map(([key, packed]) => {
        if (packed.lazy) return this.fetchLayers(key, packed);
        if (!this.decoded.has(key)) {
          this.decoded.set(key, NS.unpack(packed).then((grid) => { this.ready.set(key, grid); return grid; }));
        }
        return this.decoded.get(key);
      }));
    }

    /* A lazy payload (the notebook widget) ships shapes only: the layers this view draws are asked
     * of this.fetchLayer(kind index, field, model layer) (a Promise of one layer, packed) once each. */
    fetchLayers(key, packed) {
      if (!this.ready.has(key)) {
        const [kind, field] = key.split(":");
        this.ready.set(key, new NS.LayerGrid(packed, (layer) => this.fetchLayer(Number(kind), field, this.layerName(layer))));
      }
      const layers = this.state.view === "model" ? Array.from({ length: packed.shape[0] }, (_, l) => l) : [this.state.layer];
      const grid = this.ready.get(key);
      return Promise.all(layers.map((layer) => grid.load(layer)));
    }

    /* Draw the current view once its arrays are decoded; a newer draw request wins. */
    async draw() {
      const drawn = await drawLatest(this, () => this.ensure(), () => this.views[this.state.view].render());
      if (drawn && this.onChange) this.onChange(this);
    }

    // ---- actions ----------------------------------------------------------------------------
    setView(name) {
      this.state.view = name;
      this.syncControls();
      return this.draw();
    }
    setKind(index) {
      this.state.kind = index;
      const heads = this.nHeads();
      this.state.heads = new Set(Array.from({ length: heads }, (_, h) => h));
      this.syncControls();
      return this.draw();
    }
    /* Draw `measure` (attention, norms or a mixing method); `rollout` picks a mixing measure's rollout. */
    setMeasure(measure, rollout) {
      this.state.measure = measure;
      if (rollout !== undefined) this.state.rollout = rollout;
      this.syncControls();
      return this.draw();
    }
    setLayer(layer) {
      this.state.layer = layer;
      this.layerSelect.value = String(layer);
      return this.draw();
    }
    toggleHead(head) {
      const heads = this.state.heads;
      if (heads.has(head)) heads.delete(head); else heads.add(head);
      return this.draw();
    }
    /* Double-click: only that head; double-clicking the only head shown brings every head back. */
    soloHead(head) {
      this.state.heads = NS.soloHeads(this.state.heads, head, this.nHeads());
      return this.draw();
    }
    /* The selected query token (null: none): the head view shows only its lines, the neuron view its row. */
    selectToken(position) {
      this.state.selected = position;
      if (position !== null) this.state.query = position;
      for (const view of Object.values(this.views)) view.sync();
      return this.draw();
    }
    /* From the model view, a layer-level measure: that layer's map (or rollout) in the head view. */
    openLayer(layer, rollout) {
      this.state.layer = layer;
      this.state.rollout = rollout;
      return this.setView(this.views.head ? "head" : this.state.view);
    }
    /* From the model view: that layer, only that head, in the head view (or the neuron view if there is no head view). */
    openHead(layer, head) {
      this.state.layer = layer;
      this.state.heads = new Set([head]);
      this.state.neuronHead = head;
      return this.setView(this.views.head ? "head" : this.state.view);
    }

    // ---- export -----------------------------------------------------------------------------
    currentScene() { return this.views[this.state.view].scene; }
    fileName(extension) {
      const kind = this.kind().kind;
      const layer = this.state.view === "model" ? "" : `-layer${this.layerName(this.state.layer)}`;
      const measure = this.layerLevel() ? `-${this.state.measure}${this.state.rollout ? "-rollout" : ""}` : "";
      return `attnscope-${this.state.view}-${kind}${measure}${layer}.${extension}`;
    }
    exportSVG() { return NS.toSVG(this.currentScene()); }
    exportPNG() {
      const scene = this.currentScene();
      return NS.paint(scene, document.createElement("canvas"), 2).toDataURL("image/png");
    }
    download(format) {
      const data = format === "svg" ? this.exportSVG() : this.exportPNG();
      const url = format === "svg" ? URL.createObjectURL(new Blob([data], { type: "image/svg+xml" })) : data;
      this.lastExport = { format, name: this.fileName(format), bytes: data.length };
      const link = document.createElement("a");
      link.href = url;
      link.download = this.lastExport.name;
      document.body.append(link);
      link.click();
      link.remove();
      if (format === "svg") setTimeout(() => URL.revokeObjectURL(url), 10000);
    }
  }

  /* One draw of `app` (which has drawCount, status, root, state.view and views[name].canvas):
   * await prepare(), then render(its result) unless a newer draw began meanwhile; true if drawn.
   * When a view has drawn for the first time, root.dataset.drawn lists it, and the page's first
   * drawing sets performance mark "attnscope:<root id>:drawn". */
  async function drawLatest(app, prepare, render) {
    const ticket = ++app.drawCount;
    try {
      const data = await prepare();
      if (ticket !== app.drawCount) return false;
      render(data);
      app.status.textContent = app.notice || ""; // a notice (e.g. a measure the server refused) stays one draw
      app.notice = "";
      markDrawn(app);
      return true;
    } catch (error) {
      app.status.textContent = `attnscope: cannot draw this view: ${error.message}`;
      throw error;
    }
  }

  function markDrawn(app) {
    const root = app.root;
    const view = app.state.view;
    const done = root.dataset.drawn ? root.dataset.drawn.split(" ") : [];
    if (!done.includes(view)) {
      // reading a pixel makes the browser rasterize the canvas now, so the mark is truly "drawn"
      app.views[view].canvas.getContext("2d").getImageData(0, 0, 1, 1);
      if (!done.length) performance.mark(`attnscope:${root.id}:drawn`);
      done.push(view);
      root.dataset.drawn = done.join(" ");
    }
    root.dataset.view = view;
  }
  NS.drawLatest = drawLatest;

  /* A layer-level packed array [layer, q_pos, k_pos] read as [layer, 1, q_pos, k_pos] (one pseudo-head). */
  function headless(packed) {
    const [layers, queries, keys] = packed.shape;
    return { ...packed, shape: [layers, 1, queries, keys] };
  }

  /* The state a page address asks for, e.g. views.html#view=neuron&layer=2&head=3&query=5
   * (0-indexed; kind = index of the kind of attention; norms=1 or measure=norms for ‖αf(x)‖,
   * measure=alti (etc.) for a context-mixing measure, rollout=1 for its rollout). */
  function stateFromHash(app, hash) {
    const asked = new URLSearchParams(hash.replace(/^#/, ""));
    const number = (name, limit) => {
      const value = Number(asked.get(name));
      return asked.has(name) && Number.isInteger(value) && value >= 0 && value < limit ? value : null;
    };
    const kind = number("kind", app.payload.kinds.length);
    if (kind !== null) app.state.kind = kind;
    const shape = app.kind().attention.shape;
    const view = asked.get("view");
    if (view && app.payload.views.includes(view)) app.state.view = view;
    const layer = app.layerIndex(number("layer", Infinity));
    if (layer !== null) app.state.layer = layer;
    const head = number("head", shape[1]);
    if (head !== null) { app.state.heads = new Set([head]); app.state.neuronHead = head; }
    const query = number("query", shape[2]);
    if (query !== null) app.state.query = query;
    if (asked.get("norms") === "1") app.state.measure = "norms";
    if (asked.get("measure")) app.state.measure = asked.get("measure"); // syncControls falls back to α if not offered
    app.state.rollout = asked.get("rollout") === "1";
  }

  NS.instances = NS.instances || {};
  /* options.hash: read the starting state from the page address (standalone files, not notebooks);
   * options.onChange(app): called after every draw (the explorer keeps its address in step);
   * options.onCell(app, query, key): the head view's key token clicked while a query token is selected. */
  NS.mount = function mount(root, payload, options) {
    if (payload.format === "attnscope.longview") return NS.mountLong(root, payload, options);
    const app = new App(root, payload);
    app.onChange = options && options.onChange;
    app.onCell = options && options.onCell; // (app, query, key): a key clicked while a query is selected (head view)
    app.fetchLayer = options && options.fetchLayer;
    // options.mixing = {methods: [{method, label, reference}], fetch(method) -> Promise of a payload mixing entry}
    if (options && options.mixing) {
      app.mixingSource = options.mixing;
      app.syncControls();
    }
    NS.instances[root.id] = app;
    if (options && options.hash && window.location.hash) {
      stateFromHash(app, window.location.hash);
      app.syncControls();
    }
    app.draw();
    return app;
  };
})((window.AttnscopeViews = window.AttnscopeViews || {}));
