/* attnscope views: the page around the views — toolbar, shared state, decoding, export.
 *
 * AttnscopeViews.mount(root, payload) builds one instance in `root` (several can share a page,
 * e.g. in a notebook) and registers it in AttnscopeViews.instances[root.id]. When the first view
 * has drawn it sets performance mark "attnscope:<root id>:drawn" and root.dataset.drawn.
 */
(function (NS) {
  "use strict";

  const VIEW_NAMES = { head: "Head view", model: "Model view", neuron: "Neuron view" };
  const VIEW_CLASSES = { head: () => NS.HeadView, model: () => NS.ModelView, neuron: () => NS.NeuronView };

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
        norms: false, filter: "all", hideSpecial: false, neuronHead: 0, query: 0, selected: null,
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
    field() { return this.state.norms && this.kind().norms ? "norms" : "attention"; }
    nHeads() { return this.kind().attention.shape[1]; }
    /* The model's number of layer index `index` (payload.layers when only some layers were shipped). */
    layerName(index) { return this.payload.layers ? this.payload.layers[index] : index; }
    /* The index of model layer `number` in the shipped arrays, or null if it was not shipped. */
    layerIndex(number) {
      if (!Number.isInteger(number)) return null;
      const index = this.payload.layers ? this.payload.layers.indexOf(number) : number;
      return index >= 0 && index < this.kind().attention.shape[0] ? index : null;
    }
    /* The sliding window of shipped layer `index` in keys (query q sees q - window + 1 .. q), 0 when it sees
       every key; only the input side's self-attention slides (model.windows, one per model layer, empty when
       none does). */
    window(index) {
      const windows = this.payload.model.windows || [];
      return ["self", "encoder"].includes(this.kind().kind) ? windows[this.layerName(index)] || 0 : 0;
    }
    grid() { return this.ready.get(`${this.state.kind}:${this.field()}`); }
    weightName() { return this.field() === "norms" ? "\u2016\u03b1f(x)\u2016 (Kobayashi et al. 2020)" : "attention weight \u03b1"; }
    formatWeight(value) { return this.field() === "norms" ? value.toPrecision(3) : value.toFixed(3); }
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
      const sliding = (m.windows || []).filter((w) => w > 0);
      const slide = sliding.length ? `; ${sliding.length} layers slide over a window of ${Math.max(...sliding)} keys (grey beyond it)` : "";
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
      if (p.kinds.some((kind) => kind.norms)) {
        [this.normsLabel, this.normsBox] = NS.control("checkbox", "show \u2016\u03b1f(x)\u2016 instead of \u03b1", "norms");
        this.normsBox.addEventListener("change", () => { this.state.norms = this.normsBox.checked; this.draw(); });
        this.normsLabel.title = "norm of the weighted transformed vectors, Kobayashi et al. 2020";
        bar.append(this.normsLabel);
      }
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
      if (this.normsBox) {
        this.normsBox.disabled = !this.kind().norms;
        this.normsBox.checked = this.state.norms && !!this.kind().norms;
      }
      for (const tab of this.tabs.children) tab.classList.toggle("as-active", tab.dataset.view === this.state.view);
      for (const [name, panel] of Object.entries(this.panels)) panel.hidden = name !== this.state.view;
      this.layerLabel.hidden = this.state.view === "model";
      for (const view of Object.values(this.views)) view.sync();
    }

    // ---- decoding (lazy: only what the current kind and view need) ---------------------------
    needed() {
      const kind = this.kind();
      const fields = [this.field()];
      if (this.state.view === "neuron" && kind.vectors) fields.push("queries", "keys");
      return fields.map((field) => [`${this.state.kind}:${field}`,
        field === "queries" || field === "keys" ? kind.vectors[field] : kind[field]]);
    }

    async ensure() {
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
      return `attnscope-${this.state.view}-${kind}${layer}.${extension}`;
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
      app.status.textContent = "";
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

  /* The state a page address asks for, e.g. views.html#view=neuron&layer=2&head=3&query=5
   * (0-indexed; kind = index of the kind of attention; norms=1 for the norm toggle). */
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
    app.state.norms = asked.get("norms") === "1";
  }

  NS.instances = NS.instances || {};
  /* options.hash: read the starting state from the page address (standalone files, not notebooks);
   * options.onChange(app): called after every draw (the explorer keeps its address in step). */
  NS.mount = function mount(root, payload, options) {
    if (payload.format === "attnscope.longview") return NS.mountLong(root, payload, options);
    const app = new App(root, payload);
    app.onChange = options && options.onChange;
    app.fetchLayer = options && options.fetchLayer;
    NS.instances[root.id] = app;
    if (options && options.hash && window.location.hash) {
      stateFromHash(app, window.location.hash);
      app.syncControls();
    }
    app.draw();
    return app;
  };
})((window.AttnscopeViews = window.AttnscopeViews || {}));
