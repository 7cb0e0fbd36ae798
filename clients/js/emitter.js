// A minimal event emitter, the same in browsers and Node, with no dependency.

export class Emitter {
  #listeners = new Map();

  on(type, listener) {
    if (!this.#listeners.has(type)) this.#listeners.set(type, new Set());
    this.#listeners.get(type).add(listener);
    return () => this.off(type, listener);
  }

  off(type, listener) {
    this.#listeners.get(type)?.delete(listener);
  }

  once(type, listener) {
    const remove = this.on(type, (event) => {
      remove();
      listener(event);
    });
    return remove;
  }

  emit(type, event) {
    for (const listener of [...(this.#listeners.get(type) || [])]) {
      try {
        listener(event);
      } catch (error) {
        // A faulty listener must not break the protocol state machine; surface it asynchronously.
        setTimeout(() => {
          throw error;
        });
      }
    }
  }
}

