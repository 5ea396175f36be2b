/* attnscope views as a notebook widget: the end of the anywidget ES module.
 *
 * present/widget.py joins decode.js, scene.js, the views and app.js (which define
 * window.AttnscopeViews) and this file into one ES module (no CDN, no require.js). The page is the
 * same App as the HTML views; only its data comes differently: the payload is "lazy" (shapes and
 * scales only) and each layer the App draws is asked of the kernel with a custom message
 *   page -> kernel  {type: "fetch", id, kind, field, layer}
 *   kernel -> page  {type: "layer", id, packed} or {type: "layer", id, error}
 * The selection lives in the model's traitlets (layer, heads, selected_token, view): the page
 * writes them after every drawing and redraws when the kernel changes them.
 */
const NS = window.AttnscopeViews;
let mounted = 0;

/* fetchLayer(kind, field, layer) -> Promise of one packed layer, answered by the kernel. */
function layerFetcher(model) {
  const waiting = new Map(); // request id -> {resolve, reject}
  let next = 0;
  const onMessage = (message) => {
    if (!message || message.type !== "layer" || !waiting.has(message.id)) return;
    const { resolve, reject } = waiting.get(message.id);
    waiting.delete(message.id);
    if (message.error) reject(new Error(message.error)); else resolve(message.packed);
  };
  model.on("msg:custom", onMessage);
  const fetchLayer = (kind, field, layer) => new Promise((resolve, reject) => {
    const id = ++next;
    waiting.set(id, { resolve, reject });
    model.send({ type: "fetch", id, kind, field, layer });
  });
  return { fetchLayer, stop: () => model.off("msg:custom", onMessage) };
}

/* The App's selection as the model's traitlets hold it. */
function selection(app) {
  return {
    layer: app.layerName(app.state.layer),
    heads: [...app.state.heads].sort((a, b) => a - b),
    selected_token: app.state.selected,
    view: app.state.view,
  };
}

/* The traitlets whose value differs from the App's selection. */
function differing(app, model) {
  const now = selection(app);
  return Object.keys(now).filter((name) => JSON.stringify(model.get(name)) !== JSON.stringify(now[name]));
}

/* The App's selection -> the model's traitlets; only changed ones, as each set fires a change event. */
function push(app, model) {
  const changed = differing(app, model);
  if (!changed.length) return;
  const now = selection(app);
  for (const name of changed) model.set(name, now[name]);
  model.save_changes();
}

/* The model's traitlets -> the App's selection, then one drawing. */
function pull(app, model) {
  const state = app.state;
  const view = model.get("view");
  if (app.payload.views.includes(view)) state.view = view;
  const layer = app.layerIndex(model.get("layer"));
  if (layer !== null) state.layer = layer;
  const heads = (model.get("heads") || []).filter((head) => head >= 0 && head < app.nHeads());
  if (heads.length) {
    state.heads = new Set(heads);
    state.neuronHead = heads[0];
  }
  const selected = model.get("selected_token");
  state.selected = selected === undefined ? null : selected;
  if (state.selected !== null) state.query = state.selected;
  app.syncControls();
  return app.draw();
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.id = `attnscope-widget-${++mounted}`;
  el.append(root);
  const { fetchLayer, stop } = layerFetcher(model);
  const app = NS.mount(root, model.get("payload"), { fetchLayer, onChange: () => push(app, model) });
  const redraw = () => (differing(app, model).length ? pull(app, model) : null);
  const events = ["change:layer", "change:heads", "change:selected_token", "change:view"];
  for (const event of events) model.on(event, redraw);
  pull(app, model);
  return () => {
    stop();
    for (const event of events) model.off(event, redraw);
    delete NS.instances[root.id];
  };
}

export default { render };
