// What a refused call threw, as JSON for the Python side ({code, message}); null when it did not throw.
export async function refusal(run) {
  try {
    await run();
    return null;
  } catch (error) {
    return { code: error.code ?? null, message: error.message };
  }
}
