// Train an ONNX model exported by `gradbuilder export-web` with stock onnxruntime-web or
// onnxruntime-node: no build step, no dependency but the runtime you pass in.
//
//   import * as ort from "onnxruntime-node";            // or "onnxruntime-web"
//   import { Trainer } from "gradbuilder-train";         // or "./gradbuilder-train.mjs"
//   const trainer = await Trainer.create(ort, "artifacts/");   // a directory (Node) or a URL
//   const { loss } = await trainer.trainStep({ x: xTensor, target: yTensor });
//   const outputs = await trainer.evalStep({ x: xTensor });
//   trainer.setLearningRate(1e-4);
//   const bytes = trainer.saveState();                   // safetensors
//   const { model, data, dataName } = trainer.exportForInference();
//
// One training step is one run of training_model.onnx: each state input X (weights, optimizer
// states, Step, running statistics) is fed the tensor that the previous step returned as
// X.updated, so the state never passes through JavaScript arrays (with WebGPU it stays in GPU
// buffers); the manifest names everything. A step whose loss or gradients are not finite
// changes nothing (the graph keeps the state) and is counted in `skippedSteps`.

const TYPED = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int8: Int8Array, uint8: Uint8Array, bool: Uint8Array, float16: Uint16Array,
};
const SAFETENSORS = {
  F32: "float32", F64: "float64", I64: "int64", I32: "int32", I8: "int8", U8: "uint8", BOOL: "bool", F16: "float16",
};
const SAFETENSORS_OF = Object.fromEntries(Object.entries(SAFETENSORS).map(([k, v]) => [v, k]));

/** Read a file of the artifact directory: fetch() for URLs, node:fs for paths. */
async function readArtifact(base, name) {
  const isUrl = typeof base !== "string" || /^(https?:|blob:|data:|\/\/)/.test(base) || typeof window !== "undefined";
  if (isUrl) {
    const url = new URL(name, base instanceof URL ? base : new URL(base, globalThis.location?.href));
    const response = await fetch(url);
    if (!response.ok) throw new Error(`gradbuilder-train: cannot fetch ${url}: ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  }
  const { readFile } = await import("node:fs/promises");
  const { join } = await import("node:path");
  return new Uint8Array(await readFile(join(base, name)));
}

/** Parse safetensors bytes into {name: {dtype, dims, data}} (data: a typed array view, copied). */
export function parseSafetensors(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = Number(view.getBigUint64(0, true));
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)));
  const start = 8 + headerLength;
  const out = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const dtype = SAFETENSORS[info.dtype];
    if (!dtype) throw new Error(`gradbuilder-train: tensor '${name}' has dtype ${info.dtype}, which is not supported`);
    const [begin, end] = info.data_offsets;
    const raw = bytes.slice(start + begin, start + end); // a copy, aligned for the typed array
    const Typed = TYPED[dtype];
    out[name] = { dtype, dims: info.shape, data: new Typed(raw.buffer, raw.byteOffset, (end - begin) / Typed.BYTES_PER_ELEMENT) };
  }
  return out;
}

/** Serialize {name: {dtype, dims, data}} as safetensors bytes (names in the given order). */
export function toSafetensors(tensors) {
  const header = {};
  let offset = 0;
  const parts = [];
  for (const [name, t] of Object.entries(tensors)) {
    const bytes = new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
    header[name] = { dtype: SAFETENSORS_OF[t.dtype], shape: t.dims, data_offsets: [offset, offset + bytes.byteLength] };
    parts.push(bytes);
    offset += bytes.byteLength;
  }
  let text = JSON.stringify(header);
  text += " ".repeat((8 - ((8 + new TextEncoder().encode(text).length) % 8)) % 8); // as safetensors pads
  const head = new TextEncoder().encode(text);
  const out = new Uint8Array(8 + head.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(head.length), true);
  out.set(head, 8);
  let at = 8 + head.length;
  for (const p of parts) {
    out.set(p, at);
    at += p.byteLength;
  }
  return out;
}

function scalarTensor(ort, value) {
  return new ort.Tensor("float32", Float32Array.of(value), []);
}

export class Trainer {
  /**
   * Load the artifacts of `gradbuilder export-web` from `base` (a directory in Node, a URL in
   * a browser). `options.sessionOptions` go to both InferenceSessions (e.g.
   * {executionProviders: ["webgpu"]}); `options.read(name)` replaces the file reader.
   */
  static async create(ort, base, options = {}) {
    const read = options.read ?? ((name) => readArtifact(base, name));
    const manifest = JSON.parse(new TextDecoder().decode(await read("manifest.json")));
    if (manifest.format !== "gradbuilder-web/1") {
      throw new Error(`gradbuilder-train: ${base} holds artifacts of format ${manifest.format}, not gradbuilder-web/1`);
    }
    const [trainingBytes, evalBytes, stateBytes] = await Promise.all(
      ["training_model.onnx", "eval_model.onnx", "state.safetensors"].map(read));
    const sessionOptions = { graphOptimizationLevel: "all", ...(options.sessionOptions ?? {}) };
    const onGpu = (sessionOptions.executionProviders ?? []).some((p) => (p.name ?? p) === "webgpu");
    if (onGpu) { // the state stays in GPU buffers from one step to the next
      sessionOptions.preferredOutputLocation = Object.fromEntries(manifest.state.map((s) => [s.output, "gpu-buffer"]));
    }
    const training = await ort.InferenceSession.create(trainingBytes, sessionOptions);
    const evaluation = await ort.InferenceSession.create(evalBytes, options.sessionOptions ?? {});
    return new Trainer(ort, manifest, training, evaluation, parseSafetensors(stateBytes), read);
  }

  constructor(ort, manifest, training, evaluation, state, read) {
    this.ort = ort;
    this.manifest = manifest;
    this.training = training;
    this.evaluation = evaluation;
    this.read = read;
    this.state = {};
    for (const s of manifest.state) {
      const t = state[s.input];
      if (!t) throw new Error(`gradbuilder-train: state.safetensors has no tensor '${s.input}'`);
      this.state[s.input] = new ort.Tensor(s.dtype, t.data, s.shape);
    }
    this.learningRate = manifest.learning_rate.value;
    this.skippedSteps = 0;
  }

  /** The training graph's data inputs ({name, dtype, shape}). */
  get inputs() { return this.manifest.training.inputs; }

  setLearningRate(lr) {
    if (!(Number.isFinite(lr) && lr >= 0)) throw new Error(`gradbuilder-train: learning rate must be finite and >= 0, got ${lr}`);
    this.learningRate = lr;
  }

  getLearningRate() { return this.learningRate; }

  /** Updates done so far. */
  get step() { return Number(this.state[this.manifest.step].data[0]); }

  _check(feeds, signature, graph) {
    const expected = signature.inputs.map((i) => i.name);
    const missing = expected.filter((n) => !(n in feeds));
    const unknown = Object.keys(feeds).filter((n) => !expected.includes(n));
    if (missing.length || unknown.length) {
      throw new Error(`gradbuilder-train: the ${graph} graph takes inputs [${expected}]; missing [${missing}], unknown [${unknown}]`);
    }
  }

  /** One training step (forward, backward, optimizer): returns {loss, outputs, finite}. */
  async trainStep(feeds) {
    this._check(feeds, this.manifest.training, "training");
    const m = this.manifest;
    const results = await this.training.run({
      ...feeds, ...this.state, [m.learning_rate.input]: scalarTensor(this.ort, this.learningRate),
    });
    const finite = m.all_finite in results ? Boolean(results[m.all_finite].data[0]) : true;
    for (const s of m.state) this.state[s.input] = results[s.output]; // the graph kept the state when not finite
    if (!finite) this.skippedSteps += 1;
    const loss = results[m.loss];
    return { loss: loss.location === "cpu" || !loss.location ? Number(loss.data[0]) : Number((await loss.getData())[0]),
             outputs: Object.fromEntries(m.training.outputs.filter((n) => n in results).map((n) => [n, results[n]])),
             finite };
  }

  /** The forward in inference form with the current weights: the eval graph's outputs. */
  async evalStep(feeds) {
    this._check(feeds, this.manifest.eval, "eval");
    const given = {};
    for (const n of [...this.manifest.weights, ...this.manifest.buffers]) given[n] = await this._cpu(this.state[n]);
    return this.evaluation.run({ ...feeds, ...given });
  }

  async _cpu(tensor) {
    if (!tensor.location || tensor.location === "cpu") return tensor;
    return new this.ort.Tensor(tensor.type, await tensor.getData(), tensor.dims);
  }

  /** The state as {name: {dtype, dims, data}} (data on the CPU). */
  async getState() {
    const out = {};
    for (const s of this.manifest.state) {
      const t = await this._cpu(this.state[s.input]);
      out[s.input] = { dtype: s.dtype, dims: s.shape, data: t.data };
    }
    return out;
  }

  /** The state as safetensors bytes (what state.safetensors holds; Python reads it with
   *  safetensors.numpy.load or TrainingSession.load_state). */
  async saveState() { return toSafetensors(await this.getState()); }

  /** Replace the state with safetensors bytes of saveState() (every name, shape and type checked first). */
  loadState(bytes) {
    const loaded = parseSafetensors(bytes);
    const next = {};
    for (const s of this.manifest.state) {
      const t = loaded[s.input];
      if (!t || t.dtype !== s.dtype || t.dims.join() !== s.shape.join()) {
        throw new Error(`gradbuilder-train: loadState: '${s.input}' must be ${s.dtype} [${s.shape}], got ${t ? `${t.dtype} [${t.dims}]` : "nothing"}`);
      }
      next[s.input] = new this.ort.Tensor(s.dtype, t.data, s.shape);
    }
    this.state = next;
  }

  /** The model for inference with the trained weights: {model, data, dataName}; save both
   *  files side by side (the model reads its weights from `dataName`), or give both to
   *  ort.InferenceSession.create(model, {externalData: [{path: dataName, data}]}). */
  async exportForInference() {
    const inf = this.manifest.inference;
    const [model, template] = await Promise.all([this.read(inf.model), this.read(inf.data)]);
    const data = template.slice();
    for (const t of inf.tensors) {
      const value = (await this._cpu(this.state[t.name])).data;
      data.set(new Uint8Array(value.buffer, value.byteOffset, t.length), t.offset);
    }
    return { model, data, dataName: inf.data };
  }
}
